#!/bin/bash
# One device call: check the SGLang kit, install this checkout over it, then run gpu_session.sh
# step lists, one per GPU, at the same time. Guards against the two mistakes of session 5: a call
# without the kit (.devkit/w2 not carried), and a package install skipped after a kit reinstall
# (DDTREE flags then unknown to SGLang).
#   bash .devkit/install.sh .devkit/w2 >/dev/null && bash scripts/device_call.sh "benche2e" "syncs quick"
# Argument i holds the steps for GPU i ("" leaves that GPU idle: do that for speed runs).
# Each GPU's results land in $OUT/g<i>, packed at the end into $OUT/results.tgz (the JSON files
# also loose as $OUT/g<i>_<name>.json: the device tool returns at most 8 files); step limits and arguments come from the environment as
# gpu_session.sh reads them (BENCH_E2E_ARGS, SYNCS_CASES, ...); G<i>_NAME=value sets NAME for
# GPU i only (e.g. G1_BENCH_E2E_ARGS: two benchmarks at once need their own --port and --workdir).
set -u
OUT=${OUT:-/tmp/ddtree_out}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
if ! python3 -c "import sglang, orjson" 2>/dev/null; then
  echo "device_call: SGLang is not importable from /tmp/site (kit missing or incomplete):" \
       "run bash .devkit/install.sh on each wheel chunk (.devkit/w1, then .devkit/w2, one call" \
       "each; python3 scripts/devkit_chunks.py re-cuts a chunk too big to carry beside this" \
       "checkout and prints the calls), then this." >&2
  exit 3
fi
# A call cut by its time limit leaves its servers running on a warm machine, and the next
# call's servers then die of CUDA out-of-memory at start-up (session 25: 117 GB held by a
# killed call's Kimi server). Nothing of an earlier call should still hold a GPU here.
# Except this call's own background Marlin JIT build (gpu_session.sh jitbg, started just before
# in the same call: its pid file lies in $OUT): session 28 lost that build, and the device
# minutes it had cost, to this loop.
keep=$(cat "$OUT/jitbg.pid" 2>/dev/null || true)
descends_from_keep() {  # the process or one of its ancestors (subshell > timeout > python3)
  local p=$1
  for _ in 1 2 3 4 5; do
    [ -n "$keep" ] && [ "$p" = "$keep" ] && return 0
    p=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ')
    [ -z "$p" ] || [ "$p" -le 1 ] && return 1
  done
  return 1
}
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  if descends_from_keep "$pid"; then
    echo "device_call: leaving this call's Marlin JIT build ($pid) running" >&2
    continue
  fi
  echo "device_call: killing leftover GPU process $pid ($(ps -o args= -p "$pid" | cut -c1-80))" >&2
  kill -9 "$pid" 2>/dev/null
done
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . 2>&1 \
  | grep -v WARN | tail -2
python3 -c "import sglang_ddtree.plugin as p; p.register(); assert p.is_registered()" || {
  echo "device_call: sglang-ddtree does not register with this SGLang" >&2; exit 3; }
export DDTREE_SKIP_INSTALL=1
# jitwait's tvm-ffi cache archive lies loose in $OUT (not inside results.tgz, which must stay
# under the 16 MiB a returned file may have)
export JIT_CACHE_OUT="$OUT/tvm_ffi_cache.tgz"
pids=()
gpu=0
for steps in "$@"; do
  if [ -n "$steps" ]; then
    mkdir -p "$OUT/g$gpu"
    # per-GPU settings: G<i>_NAME=value becomes NAME=value for GPU i's steps only
    overrides=()
    for var in $(compgen -v "G${gpu}_"); do overrides+=("${var#G${gpu}_}=${!var}"); done
    # shellcheck disable=SC2086  # the steps are words
    env "${overrides[@]}" CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/g$gpu" bash scripts/gpu_session.sh $steps \
      > "$OUT/g$gpu/console.txt" 2>&1 &
    pids+=($!)
  fi
  gpu=$((gpu + 1))
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
for d in "$OUT"/g*; do echo "=== $d"; tail -15 "$d/session.log" 2>/dev/null; done
# The device tool brings back at most 8 files from $OUT: everything goes into one archive, and
# the JSON results (up to 7) also lie loose as g<i>_<name>.json.
(cd "$OUT" && tar czf results.tgz g* && rm -rf g*)
n=0
loose=7
[ -f "$JIT_CACHE_OUT" ] && loose=6  # the tool returns 8 files at most
for f in $(tar tzf "$OUT/results.tgz" | grep '\.json$'); do
  [ $n -lt $loose ] || break
  tar xzf "$OUT/results.tgz" -C "$OUT" "$f" && mv "$OUT/$f" "$OUT/$(dirname "$f")_$(basename "$f")"
  n=$((n + 1))
done
rmdir "$OUT"/g* 2>/dev/null
exit $rc
