#!/bin/bash
# One device call's worth of GPU work, in priority order, each step time-boxed, results in $OUT.
# Run from the repo root on the H200 after the devkit chunks are installed into /tmp/site:
#   bash scripts/gpu_session.sh unit e2e   # steps: quick pytest unit cudaext treeclocks treebench moe moetune moeq jitbg jitwait moebench moee2e det syncs e2e e2e2gpu tp2 verify train benche2e costs profile memcheck memchecktree memcheckverify doctor commit bench fmla draftattn drafte2e draftfi draftab moegrid moegridmid moelive moelivetest skinny skinnyrouter skinnyserve skinnycosts kimifmla moedual kimiprofile moeprologue moealign moeserve moehalf mlareduce fa3 tvwide tvwidecheck fmlabatch tvncu tvtail fa3prefix prefixauto mlakt mergetile mergecheck mlagrid tvspec moencu moewave widemla widemlaserve widemlacosts mlahopper moebm8 moebm8wide moebm8check moedownwave moelivedown moem9 moesmall moewarps grammar grammarmla moestall moepar moewide moetableab moepdl moepdlab moeearly moerows moes60ab moem8pdl moem16split moegoal gemmlt gemmsmall gemmpdl moebm32 moem28 kimiprofile61 routercosts
# Every step appends to $OUT/session.log; JSON results land in $OUT; logs are tarred at the end.
set -u
OUT=${OUT:-/tmp/ddtree_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SGLANG_DDTREE_CACHE_DIR=/tmp/ddtree_cache
[ -n "${DDTREE_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v WARN | tail -2
log() { echo "== $(date +%T) $*" | tee -a "$OUT/session.log"; }
# SGLang's JIT kernels (its Marlin MoE: minutes of nvcc on first use) from a cache an earlier call
# saved (jitwait writes it): carry .devkit/tvm_ffi_cache.tgz and it is unpacked here, once
if [ -f .devkit/tvm_ffi_cache.tgz ] && [ ! -d "$HOME/.cache/tvm-ffi" ]; then
  mkdir -p "$HOME/.cache" && tar xzf .devkit/tvm_ffi_cache.tgz -C "$HOME/.cache" \
    && log "tvm-ffi JIT cache unpacked from .devkit/tvm_ffi_cache.tgz"
fi
# An 80 GB card (H100) holds fewer servers at once than the H200's 141 GB: the e2e steps below
# take this where the card has less than 100,000 MiB (bench_cost_curves.py picks its own
# --mem-fraction for the card: default_mem_fraction)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
card_serve_args=""
if [ "${gpu_mib:-0}" -gt 0 ] 2>/dev/null && [ "$gpu_mib" -lt 100000 ]; then
  card_serve_args="--max-servers 2"
  log "an ${gpu_mib} MiB card: e2e_lossless $card_serve_args"
fi
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  log "$name (limit ${secs}s): $*"
  timeout "$secs" "$@" >> "$OUT/session.log" 2>&1
  log "$name rc=$?"
}
moe_ab() {  # moe_ab NAME LIMIT ROUNDS "MS" STEM VARIANT...: whole fused-MoE calls of the table
  # against each --ours-variants VARIANT, interleaved, on each routing of $ROUTINGS (default:
  # random routing then 8 shared experts), JSON to $OUT/STEM_<routing>_h200.json (no kit)
  local name=$1 limit=$2 rounds=$3 ms=$4 stem=$5 routing; shift 5
  for routing in ${ROUTINGS:-random concentrated:8}; do
    step $name-${routing/:/} $limit python3 scripts/bench_fused_moe.py --no-sglang --check \
      --rounds $rounds --routing $routing --ms $ms --ours-variants "$@" \
      --out "$OUT/${stem}_${routing/:/}_h200.json"
  done
}
kimi61_costs() {  # kimi61_costs NAME LIMIT BUDGETS STEM [ARG...]: AR decode and DDTREE's verify
  # at BUDGETS on the 61-layer int4 Kimi rank (the rank's vocabulary, our fused MoE, dummy int4
  # seed 1234), batch 1, JSON to $OUT/cost_curves_kimi_l61_STEM_h200.json; ARGs are added
  # (--baselines= drops AR, --server-env K=V a switch on every server); BUDGETS "" runs AR only
  local name=$1 limit=$2 budgets=$3 stem=$4; shift 4
  step $name $limit python3 scripts/bench_cost_curves.py \
    --out "$OUT/cost_curves_kimi_l61_${stem}_h200.json" \
    --models kimi-k2.6-tp8rank-l61-int4-rankvocab --baselines ar --budgets= \
    --timer-budgets "$budgets" --concurrency 1 \
    --server-env SGLANG_DDTREE_FUSED_MOE=1 --server-env SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=1234 "$@"
}
for s in "$@"; do
  case $s in
    quick)   step quick ${QUICK_LIMIT:-280} python3 -m pytest -q tests/gpu/test_cuda_ext_tree_gpu.py \
               tests/gpu/test_step_graph_gpu.py tests/gpu/test_tree_graph_gpu.py tests/test_kv_move.py \
               tests/test_step_prep.py tests/gpu/test_sampling_gpu.py tests/gpu/test_step_timers_gpu.py ;;
    pytest)  step pytest ${PYTEST_LIMIT:-200} python3 -m pytest -q ${PYTEST_ARGS:-tests/gpu} ;;
    unit)    step unit 180 python3 -m pytest -q tests/gpu/test_tree_gpu.py \
               tests/gpu/test_tree_graph_gpu.py tests/gpu/test_tree_attention_gpu.py ;;
    cudaext) step cudaext ${CUDAEXT_LIMIT:-240} python3 -m pytest -q -x tests/gpu/test_cuda_ext_tree_gpu.py ${CUDAEXT_K:+-k "$CUDAEXT_K"}
             step cudaext-bench ${CUDAEXT_BENCH_LIMIT:-120} python3 scripts/bench_tree_build.py --out "$OUT/tree_build_h200.json" ${CUDAEXT_BENCH_ARGS:-} ;;
    treeclocks) # where the tree kernels spend their time (clock64 marks; a diagnostic)
             step tree-clocks ${TREE_CLOCKS_LIMIT:-150} python3 scripts/tree_build_clocks.py \
               --out "$OUT/tree_clocks_h200.json" ${TREE_CLOCKS_ARGS:-} ;;
    treebench) # only the tree-build benchmark (after quick, which already ran the parity tests)
             step cudaext-bench ${CUDAEXT_BENCH_LIMIT:-120} python3 scripts/bench_tree_build.py --out "$OUT/tree_build_h200.json" ${CUDAEXT_BENCH_ARGS:-} ;;
    moe)     step moe 120 python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "not sglang"
             step moe-vs-sglang 330 python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k sglang
             step moe-tune 240 python3 scripts/bench_fused_moe.py --tune --ms 8 16 32 64 128 256 512 1024 2048 \
               --tune-out triton_kernels/moe_w4a16_configs.json
             cp triton_kernels/moe_w4a16_configs.json "$OUT/"
             step moe-bench 200 python3 scripts/bench_fused_moe.py --check --out "$OUT/fused_moe_h200.json" ;;
    moetune) # every gate-up candidate's time at decode and verify sizes, on random routing and
             # on routing concentrated on 9 experts (as under SGLang's stock dummy fill); bands
             # in $OUT only: the shipped table is not touched
             step moe-tune-random ${MOE_TUNE_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang --tune \
               --ms 1 2 4 8 16 32 64 --out "$OUT/fused_moe_tune_random.json" --tune-out "$OUT/table_random.json"
             step moe-tune-conc ${MOE_TUNE_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang --tune \
               --routing concentrated:9 --ms 1 8 16 32 64 --out "$OUT/fused_moe_tune_conc9.json" \
               --tune-out "$OUT/table_conc9.json" ;;
    moeq)    # the MoE kernel's first GPU run in one call: correctness, then the benchmark with
             # the repo's untuned configs (the comparison with SGLang's paths and tuning: moe)
             step moe ${MOE_LIMIT:-150} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "not sglang"
             step moe-bench ${MOE_BENCH_LIMIT:-240} python3 scripts/bench_fused_moe.py --check --out "$OUT/fused_moe_h200.json" ;;
    jitbg)   # SGLang 0.5.17 builds its Marlin MoE kernel with nvcc on first use (load_jit; more
             # than 170 s in session 9): start that build in the background, on the CPU, so that
             # later steps (moebench, moee2e) find it in the tvm-ffi cache; jitwait waits for it
             log "jit-bg: building SGLang's Marlin MoE JIT module in the background"
             ( timeout "${JITBG_LIMIT:-900}" python3 scripts/bench_fused_moe.py --profiler \
                 --baselines sglang_marlin --ms 8 --layers 1 --iters 1 --out "$OUT/jitwarm.json" \
                 > "$OUT/jitwarm.log" 2>&1; log "jit-bg rc=$?" ) &
             echo $! > "$OUT/jitbg.pid" ;;
    jitwait) # (a pid file: a pgrep for the command line would also match this waiting shell)
             step jit-wait ${JITWAIT_LIMIT:-600} bash -c \
               'p=$(cat "$1" 2>/dev/null) || exit 0; while kill -0 "$p" 2>/dev/null; do sleep 5; done' \
               _ "$OUT/jitbg.pid"
             # the built cache, for later calls to carry (outside results.tgz: it may be large),
             # only once the build has ended and every module has its .so (session 10: a cache
             # saved while nvcc still ran held no Marlin MoE module)
             if p=$(cat "$OUT/jitbg.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null; then
               log "jit cache not saved: the build is still running"
             elif [ -d "$HOME/.cache/tvm-ffi" ]; then
               missing=$(for d in "$HOME"/.cache/tvm-ffi/*/; do ls "$d"*.so >/dev/null 2>&1 || echo "$d"; done)
               if [ -n "$missing" ]; then
                 log "jit cache not saved: modules without a .so: $missing"
               else
                 tar czf "${JIT_CACHE_OUT:-$OUT/tvm_ffi_cache.tgz}" -C "$HOME/.cache" tvm-ffi \
                   && log "jit cache saved: $(du -h "${JIT_CACHE_OUT:-$OUT/tvm_ffi_cache.tgz}" | cut -f1)"
               fi
             fi ;;
    moebench) # the fused MoE kernel vs SGLang's paths in one run (table configs; no tuning)
             step moe-bench ${MOE_BENCH_LIMIT:-240} python3 scripts/bench_fused_moe.py --check \
               --out "$OUT/fused_moe_h200.json" ${MOE_BENCH_ARGS:-} ;;
    moee2e)  # issue 5's end-to-end check: a few-layer int4 Kimi rank, stock MoE vs ours
             step moe-e2e ${MOE_E2E_LIMIT:-300} python3 scripts/e2e_fused_moe.py \
               --out "$OUT/e2e_fused_moe_h200.json" ${MOE_E2E_ARGS:-}
             (cd /tmp && tar czf "$OUT/moe_e2e_logs.tgz" ddtree_e2e_moe/*.log 2>/dev/null) ;;
    verify)  SGLANG_DDTREE_VERIFY_E2E_OUT=$OUT/verify_backend_e2e_dense_h200.json \
               step verify-dense 560 python3 -m pytest -q -s tests/gpu/test_verify_backend_gpu.py -k dense ;;
    tp2)     step e2e-tp2 ${E2E_LIMIT:-540} python3 scripts/e2e_lossless.py --tp 2 \
               --out "$OUT/e2e_lossless_h200x2_tp2.json" --ddtree-env SGLANG_DDTREE_CHECK_RANKS=1 ${E2E_ARGS:-} ;;
    det)     # only the deterministic AR + DDTREE pair (seeded T > 0), e.g. on the second GPU
             step e2e-det ${DET_LIMIT:-300} python3 scripts/e2e_lossless.py --cases "" --eager-check= \
               --speed= --deterministic "${DET_CASE:-tiny:32}" --port ${DET_PORT:-32100} \
               --workdir /tmp/ddtree_e2e_det --out "$OUT/e2e_lossless_h200_det.json" ${DET_ARGS:-} ;;
    syncs)   # one lossless case with SGLANG_DDTREE_CHECK_SYNCS=1: every host sync inside the
             # decode step (ours and the SGLang code it calls), logged per call site. The lossless
             # cases plant oracle drafts, whose 5 syncs a step (oracle.py, a test-only mode) show
             # in the log (session 63); SYNCS_SPEED (e.g. "kimi_int4:15") also runs that
             # model's speed servers, whose drafts are the drafter's own: the served path
             step syncs ${SYNCS_LIMIT:-300} python3 scripts/e2e_lossless.py --cases "${SYNCS_CASES:-tiny:32;mla:32}" \
               --eager-check= --speed="${SYNCS_SPEED:-}" --deterministic= --workdir /tmp/ddtree_e2e_syncs --port 32300 \
               ${SYNCS_ARGS:-} --ddtree-env SGLANG_DDTREE_CHECK_SYNCS=1 --out "$OUT/e2e_sync_check_h200.json"
             grep -h "sync check" /tmp/ddtree_e2e_syncs/*.log > "$OUT/sync_check_h200.log" ;;
    grammar) # (session 50, written without a GPU) grammar-constrained requests served: regex, JSON
             # schema, EBNF and unconstrained prompts mixed in every batch on the tiny pair (with
             # its tokenizer, xgrammar); tokens/s of AR, DFLASH and DDTREE budgets 8 / 32 one
             # server at a time, then DDTREE and DFLASH against AR token for token, every
             # constrained output checked with xgrammar (scripts/e2e_grammar.py)
             step grammar ${GRAMMAR_LIMIT:-540} python3 scripts/e2e_grammar.py \
               --out "$OUT/e2e_grammar_h200.json" ${GRAMMAR_ARGS:-} ;;
    grammarmla) # (session 51) the same lossless and grammar checks (no speed phase, no DFLASH)
             # on the MLA + MoE target (dummy weights, config only, the tiny pair's tokenizer)
             # at budgets 8 / auto, then on the tiny pair at budget auto. Session 51 ran the MLA
             # part without oracle drafts (accept length 1.02); --oracle (added after) plants
             # AR's constrained outputs for long accepted paths (GRAMMAR_MLA_ORACLE= drops it)
             step grammar-mla ${GRAMMAR_MLA_LIMIT:-280} python3 scripts/e2e_grammar.py --model mla \
               --budgets 8,auto --no-dflash --speed-batch-sizes= --workdir /tmp/ddtree_grammar_mla \
               ${GRAMMAR_MLA_ORACLE---oracle} --out "$OUT/e2e_grammar_mla_h200.json"
             step grammar-auto ${GRAMMAR_AUTO_LIMIT:-240} python3 scripts/e2e_grammar.py \
               --budgets auto --no-dflash --speed-batch-sizes= --workdir /tmp/ddtree_grammar_auto \
               --port 30500 --out "$OUT/e2e_grammar_auto_h200.json" ;;
    e2e)     step e2e ${E2E_LIMIT:-480} python3 scripts/e2e_lossless.py --out "$OUT/e2e_lossless_h200.json" ${E2E_ARGS:-} ;;
    e2e2gpu) # the suite split over the two GPUs of nvidia-h200-x2, both halves at once:
             # GPU 0 the core cases (+ speed, deterministic pair), GPU 1 the other backends and paging
             CUDA_VISIBLE_DEVICES=1 step e2e-b ${E2E_LIMIT:-540} python3 scripts/e2e_lossless.py \
               --cases "${E2E_B_CASES:-tiny_page16:32;tiny_flashinfer:32;tiny_tv:32;mla_tv:32,auto;tiny_kvsglang:32;mla_kvsglang:32;tiny_fisample:32}" \
               --eager-check= --speed= --deterministic= --port 32100 --workdir /tmp/ddtree_e2e_b \
               --out "$OUT/e2e_lossless_h200_backends.json" &
             CUDA_VISIBLE_DEVICES=0 step e2e-a ${E2E_LIMIT:-540} python3 scripts/e2e_lossless.py \
               --cases "${E2E_A_CASES:-tiny:8,32,64,auto;mla:8,32,64}" \
               --out "$OUT/e2e_lossless_h200.json" ${E2E_ARGS:-}
             wait ;;
    train)   step train 420 python3 scripts/train_tiny_pair.py --copy-to "$OUT" ${TRAIN_ARGS:-} ;;
    benche2e) # no new point in the last 90 s of the step: the -timers servers and the dump
             # still run (an explicit --time-budget in BENCH_E2E_ARGS wins: it comes later)
             step bench-e2e ${BENCH_E2E_LIMIT:-560} python3 scripts/bench_e2e.py \
               --out "$OUT/bench_e2e_tiny_h200.json" --time-budget $(( ${BENCH_E2E_LIMIT:-560} - 90 )) \
               ${BENCH_E2E_ARGS:-}
             (cd /tmp && tar czf "$OUT/bench_e2e_logs.tgz" ddtree_bench_e2e/*.log 2>/dev/null) ;;
    memchecktree) step memcheck ${MEMCHECK_LIMIT:-240} env PYTHON=python3 bash scripts/memcheck_tree_build.sh ;;
    memcheckverify) step memcheck-verify ${MEMCHECK_LIMIT:-240} env PYTHON=python3 bash scripts/memcheck_tree_verify.sh ;;
    memcheck) step memcheck ${MEMCHECK_LIMIT:-240} env PYTHON=python3 bash scripts/memcheck_tree_build.sh
             step memcheck-verify ${MEMCHECK_LIMIT:-240} env PYTHON=python3 bash scripts/memcheck_tree_verify.sh ;;
    costs)   step costs ${COSTS_LIMIT:-560} python3 scripts/bench_cost_curves.py --out "$OUT/cost_curves_h200.json" ${COSTS_ARGS:-}
             (cd /tmp && tar czf "$OUT/cost_curves_logs.tgz" ddtree_cost_curves/*.log 2>/dev/null) ;;
    profile) # the int4 Kimi rank on our fused MoE needs PROFILE_ARGS="... --server-env
             # SGLANG_DDTREE_FUSED_MOE=1" (session 30 profiled Marlin without it); the JSON is
             # rewritten after every method, so a time limit keeps the finished ones
             step profile ${PROFILE_LIMIT:-300} python3 scripts/profile_step.py --out "$OUT/profile_step_h200.json" ${PROFILE_ARGS:-} ;;
    doctor)  # every kernel, planned for 131,072 tokens since session 25 (140 cases with FlashMLA)
             step doctor ${DOCTOR_LIMIT:-300} python3 -m sglang_ddtree.cli doctor --graphs \
               --out "$OUT/doctor_graphs_h200.json" ${DOCTOR_ARGS:-} ;;
    commit)  # the accept/commit stage per call, op path vs the one-launch walk_commit
             step commit ${COMMIT_LIMIT:-150} python3 scripts/bench_commit.py --out "$OUT/commit_h200.json" ${COMMIT_ARGS:-} ;;
    bench)   step bench ${BENCH_LIMIT:-240} python3 scripts/bench_tree_verify.py --out "$OUT/tree_verify_h200.json" ${BENCH_ARGS:-} ;;
    fmla)    # SGLANG_DDTREE_MLA_PREFIX=flashmla on the GPU: FlashMLA's contract and the merged
             # attention (tests), the doctor's graph rows, then the MLA benchmark points with the
             # prefix on FlashMLA beside our kernel alone (no SGLang baseline: fast)
             step fmla-tests ${FMLA_LIMIT:-200} python3 -m pytest -q tests/gpu/test_mla_prefix_gpu.py
             step fmla-doctor ${FMLA_LIMIT:-200} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mla,mla_flashmla --out "$OUT/doctor_graphs_fmla_h200.json"
             step fmla-bench ${FMLA_BENCH_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mla \
               --mla-prefix --no-baselines --out "$OUT/tree_verify_fmla_h200.json" ${FMLA_BENCH_ARGS:-} ;;
    draftattn) # SGLANG_DDTREE_DRAFT_ATTENTION=triton: the doctor's draft rows, the drafter's
             # block attention on our kernel vs SGLang's triton extend (kernel), lossless with it
             # (oracle drafts); draftab: the tiny pair with it (the default) and without
             step draft-doctor 120 python3 -m sglang_ddtree.cli doctor --graphs --kernels draft \
               --out "$OUT/doctor_graphs_draft_h200.json"
             step draft-bench ${DRAFT_BENCH_LIMIT:-200} python3 scripts/bench_draft_attention.py \
               --out "$OUT/draft_attention_h200.json" ${DRAFT_BENCH_ARGS:-}
             step draft-e2e ${E2E_LIMIT:-300} python3 scripts/e2e_lossless.py \
               --cases "${DRAFT_E2E_CASES:-tiny_dtv:8,32;mla_dtv:8,32}" --batch-sizes 1,4,16 \
               --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_draft_triton_h200.json" ;;
    drafte2e) # only draftattn's lossless cases (the drafter's attention on our kernel, served)
             step draft-e2e ${E2E_LIMIT:-300} python3 scripts/e2e_lossless.py \
               --cases "${DRAFT_E2E_CASES:-tiny_dtv:8,32;mla_dtv:8,32}" --batch-sizes 1,4,16 \
               --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_draft_triton_h200.json" ;;
    draftfi) # ours against FlashInfer's paged prefill (SGLang's flashinfer drafter backend) at
             # short and long contexts: whether auto should move flashinfer drafters too
             step draft-fi ${DRAFT_FI_LIMIT:-240} python3 scripts/bench_draft_attention.py \
               --baselines flashinfer --contexts ${DRAFT_FI_CONTEXTS:-512,2048,8192,32768} \
               --out "$OUT/draft_attention_flashinfer_h200.json" ${DRAFT_FI_ARGS:-} ;;
    draftab) # DDTREE's default (auto: a triton drafter on our kernel) against the drafter on
             # SGLang's backend (native)
             step draft-ab ${DRAFT_AB_LIMIT:-300} python3 scripts/bench_e2e.py --budgets 16 \
               --concurrency 1,8 --modes greedy --repeats 2 --timer-budgets 16 \
               --timer-concurrency 1 --variant dnat:SGLANG_DDTREE_DRAFT_ATTENTION=native \
               --time-budget ${DRAFT_AB_TIME:-220} \
               --out "$OUT/bench_e2e_draft_triton_h200.json" ${DRAFT_AB_ARGS:-} ;;
    moegrid) # gate-up K splits for the decode-sized MoE bands (M 2 / 3-4 / 5-8) on routings
             # that touch few experts (session 25: budget 7, 8-token calls on the dummy fill's 8
             # experts, cost more than budget 8); pick with --pick-from afterwards, no GPU
             step moe-grid ${MOE_GRID_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_GRID_MS:-2 3 4 5 6 8} --routings concentrated:8,concentrated:32,random \
               --grid "${MOE_GRID:-32,128,2,4,0,1,1;32,128,2,4,0,1,2;32,128,2,4,0,1,4;32,128,2,4,0,1,8;32,256,2,3,0,1,2;32,256,2,3,0,1,4;32,256,2,3,0,1,7;64,256,4,3,0,1,2;64,256,4,3,0,1,4}" \
               --out "$OUT/fused_moe_small_grid_h200.json" ;;
    moegridmid) # the M 17-32 / 33-64 bands' K split with the one-launch split-K (session 26:
             # split 4 at M = 17 was 0.89x on 8 experts and 1.01x on random; at M = 33 1.05x on
             # random); every M of the bands that a verify of budget 16-63 at batch 1-2 takes
             step moe-grid-mid ${MOE_GRID_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_GRID_MS:-17 24 32 33 48 64} --routings concentrated:8,concentrated:32,random \
               --grid "${MOE_GRID:-64,256,4,3,0,1,4;64,256,4,3,0,1,7;32,256,2,3,0,1,4;32,256,2,3,0,1,7}" \
               --out "$OUT/fused_moe_mid_grid_h200.json" ;;
    moelivetest) # the gate-up's live split (split_target) on the GPU: its tests and the
             # one-launch split-K's
             step moe-live-tests ${MOE_LIVE_TEST_LIMIT:-240} python3 -m pytest -q \
               tests/gpu/test_moe_w4a16_gpu.py -k "live_split or serial_split" ;;
    moelive) # the gate-up's live split (split_target: the split per call from the used-block
             # count, on the GPU) per band, its candidates against the table on 8 / 32 shared
             # experts and on random routing (one JSON per band group, in MOE_LIVE_GROUPS order)
             for g in ${MOE_LIVE_GROUPS:-m17_64 m5_8 m9_16 m2_4}; do
               case $g in
                 m2_4)   ms="2 4"; cands="64,256,4,3,0,1,4,128;64,256,4,3,0,1,4,256;64,256,4,3,0,1,4,512" ;;
                 m5_8)   ms="5 7 8"; cands="32,128,2,4,0,1,8,256;32,128,2,4,0,1,8,512;32,128,2,4,0,1,8,1024;32,128,2,4,0,1,4,512" ;;
                 m9_16)  ms="9 12 16"; cands="32,256,2,3,0,1,4,512;32,256,2,3,0,1,4,1024;32,256,2,3,0,1,4,2048;32,256,2,3,0,1,7,1024;64,256,4,3,0,1,4,512" ;;
                 m17_64) ms="17 24 32 33 48 64"; cands="64,256,4,3,0,1,4,256;64,256,4,3,0,1,4,512;64,256,4,3,0,1,7,512;64,256,4,3,0,1,7,1024;32,256,2,3,0,1,4,512;32,256,2,3,0,1,4,1024" ;;
               esac
               step moe-live-$g ${MOE_LIVE_LIMIT:-200} python3 scripts/bench_fused_moe.py --no-sglang \
                 --ms $ms --routings concentrated:8,concentrated:32,random --grid "$cands" \
                 --out "$OUT/fused_moe_live_grid_${g}_h200.json"
             done ;;
    skinny)  # the skinny bf16 GEMM (session 30; first GPU run session 32: skinny_gemm_h200_s32.json): its GPU tests and the
             # SGLANG_DDTREE_SKINNY_GEMM hook's, then against cuBLAS at the Kimi rank's shapes
             step skinny-tests ${SKINNY_TEST_LIMIT:-240} python3 -m pytest -q \
               tests/gpu/test_skinny_gemm_gpu.py tests/gpu/test_dense_hook_gpu.py
             # (the sweep: 32- and 128-column tiles and 256-deep K steps, splits planned alike,
             # and the default tile at 4 stages: one program per SM at 33-64 rows, which
             # launch_stages avoids with 3)
             step skinny-bench ${SKINNY_LIMIT:-420} python3 scripts/bench_skinny_gemm.py \
               --out "$OUT/skinny_gemm_h200.json" \
               --sweep "${SKINNY_SWEEP:-32,128,0;128,128,0;64,256,0;64,128,0,4,4}" ${SKINNY_ARGS:-} ;;
    skinnyrouter) # the router's fp32-output GEMM (Kimi: 384 x 7168): ours into fp32 against
             # cuBLAS as SGLang's linear_bf16_fp32 calls it, at the rows the hook would take
             step skinny-tests ${SKINNY_TEST_LIMIT:-120} python3 -m pytest -q tests/gpu/test_dense_hook_gpu.py
             step skinny-router ${SKINNY_LIMIT:-180} python3 scripts/bench_skinny_gemm.py \
               --shapes 384x7168 --fp32-out --ms 1 8 16 17 24 32 33 \
               --out "$OUT/skinny_gemm_router_fp32_h200.json" --sweep "32,128,0;64,256,0" ;;
    skinnyserve) # SGLANG_DDTREE_SKINNY_GEMM=1 (17-32 rows, wide-K weights and the router) on
             # the DDTREE servers only, the int4 Kimi rank against AR on cuBLAS, token for token:
             # budgets 16 / 31 (verify rows 17 / 32) at batch 1 / 4
             step skinny-serve ${SKINNY_SERVE_LIMIT:-360} python3 scripts/e2e_lossless.py \
               --cases "${SKINNY_SERVE_CASES:-kimi_int4:16,31}" --batch-sizes 1,4 --prompts 12 \
               --eager-check= --speed= --deterministic= --ddtree-env SGLANG_DDTREE_SKINNY_GEMM=1 \
               --out "$OUT/e2e_lossless_kimi_int4_skinny_h200.json" ;;
    skinnycosts) # the 61-layer int4 rank at batch 1 with the switch on every server (AR decode's
             # one row is outside 17-32), budgets 16 / 31: against session 28 / 32's 1.268 / 1.408
             step skinny-costs ${COSTS_LIMIT:-560} python3 scripts/bench_cost_curves.py \
               --out "$OUT/cost_curves_kimi_skinny_h200.json" \
               --models kimi-k2.6-tp8rank-l61-int4-rankvocab --baselines ar --budgets= \
               --timer-budgets ${SKINNY_COSTS_BUDGETS:-16,31} --concurrency 1 \
               --server-env SGLANG_DDTREE_FUSED_MOE=1 --server-env SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=1234 \
               --server-env SGLANG_DDTREE_SKINNY_GEMM=1 ;;
    kimifmla) # issue 6's ratio as a Hopper Kimi deployment serves it: the 61-layer int4 rank at
             # batch 1 on SGLang's flashmla backend with 64-token pages (AR decode on FlashMLA;
             # DDTREE's verify with the prefix on FlashMLA under auto and session 35's merge
             # tile), budgets 16 / 31: against 1.268 / 1.408 on the triton backend at page 1
             # (sessions 28 / 32)
             step kimi-fmla ${COSTS_LIMIT:-560} python3 scripts/bench_cost_curves.py \
               --out "$OUT/cost_curves_kimi_fmla_h200.json" \
               --models kimi-k2.6-tp8rank-l61-int4-rankvocab --baselines ar --budgets= \
               --timer-budgets ${KIMI_FMLA_BUDGETS:-16,31} --concurrency 1 \
               --attention-backend flashmla --page-size 64 \
               --server-env SGLANG_DDTREE_FUSED_MOE=1 --server-env SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=1234 ;;
    moedual) # our MoE beside the shared expert on SGLang's second stream (its DeepseekV2 layer
             # in CUDA graphs) against each alone, 16 weight sets a graph (no L2 reuse across
             # layers); session 30's in-server gate-up times were above the kernel-only bench
             step moe-dual ${MOE_DUAL_LIMIT:-240} python3 scripts/bench_fused_moe.py --no-sglang \
               --dual-stream --ms ${MOE_DUAL_MS:-1 8 9 16 17 33} --layers ${MOE_DUAL_LAYERS:-16} \
               --routings ${MOE_DUAL_ROUTINGS:-concentrated:9,random} --rounds 3 \
               --out "$OUT/fused_moe_dual_stream_h200.json" ;;
    kimiprofile) # profile (above) on the 8-layer int4 Kimi rank on our fused MoE, batch 1:
             # AR and DDTREE at KIMI_PROFILE_BUDGETS (kernel families, busy time, overlap)
             step kimi-profile ${PROFILE_LIMIT:-450} python3 scripts/profile_step.py \
               --out "$OUT/profile_step_kimi_h200.json" --dummy \
               --target bench_assets/model-configs/kimi-k2.6-tp8rank-l8-int4 \
               --draft bench_assets/model-configs/kimi-k2.6-tp8rank-l8-int4-dflash-draft \
               --methods ar,ddtree --budget ${KIMI_PROFILE_BUDGETS:-32,16,8} --steps 20 \
               --max-new-tokens 96 --server-env SGLANG_DDTREE_FUSED_MOE=1 \
               --server-env SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=1234 ;;
    kimiprofile61) # (session 70) profile on the 61-layer int4 Kimi rank with the rank's
             # vocabulary (the cost curves' model, whose weights do not fit L2 as the 8-layer
             # rank's partly do), batch 1, AR and DDTREE at KIMI_PROFILE_BUDGETS (default 31),
             # one server at a time (it fills an 80 GB H100 alone). Session 70's call (400 s)
             # profiled AR only before its limit: KIMI_PROFILE_METHODS=ddtree profiles the
             # DDTREE server alone, for profile_step.py --compare against
             # bench_results/profile_step_kimi_l61_ar_partial_h100_s70.json. Budgets 15 and 31
             # in one call (KIMI_PROFILE_BUDGETS=15,31) give the kernels behind the step from
             # a verify that meets the issue's 1.15 (budget 15 on an H100) to one that does not
             # (--compare ... --pairs ddtree_b15:ddtree_b31)
             step kimi-profile61 ${PROFILE_LIMIT:-450} python3 scripts/profile_step.py \
               --out "$OUT/profile_step_kimi_l61_h200.json" --dummy --serial \
               --target bench_assets/model-configs/kimi-k2.6-tp8rank-l61-int4-rankvocab \
               --draft bench_assets/model-configs/kimi-k2.6-tp8rank-l61-int4-rankvocab-dflash-draft \
               --methods ${KIMI_PROFILE_METHODS:-ar,ddtree} --budget ${KIMI_PROFILE_BUDGETS:-31} --steps ${KIMI_PROFILE_STEPS:-10} \
               --max-new-tokens 64 --server-env SGLANG_DDTREE_FUSED_MOE=1 \
               --server-env SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=1234 ;;
    moeprologue) # the MoE prologue alone (grouping + x's copy; session 39: one launch 4.8 us
             # at M = 1 up to 82 at 2,048, two launches 9.7-28), both copy layouts, both
             # groupings, 1 / 2 / 4 warps
             step moe-prologue ${MOE_PROLOGUE_LIMIT:-200} python3 scripts/bench_fused_moe.py --no-sglang \
               --prologue --ms ${MOE_PROLOGUE_MS:-1 8 16 64 128 256 512 1024 2048} \
               --routings concentrated:8,random --out "$OUT/fused_moe_prologue_h200.json" ;;
    moealign) # whole MoE calls: the shipped grouping (two launches from 2,048 pairs, x copied
             # per chunk there) against one launch and against two launches with x copied per
             # row (session 39 timed only the latter pair in whole calls), then the combine
             # launch's shapes alone
             step moe-align ${MOE_ALIGN_LIMIT:-240} python3 scripts/bench_fused_moe.py --no-sglang \
               --rounds 3 --ms ${MOE_ALIGN_MS:-128 256 512 1024 2048} \
               --ours-variants one:SGLANG_DDTREE_MOE_ALIGN=one \
               tworows:SGLANG_DDTREE_MOE_ALIGN=two,SGLANG_DDTREE_MOE_PROLOGUE=rows \
               --out "$OUT/fused_moe_align_ab_h200.json"
             step moe-combine ${MOE_COMBINE_LIMIT:-120} python3 scripts/bench_fused_moe.py --no-sglang \
               --combine --out "$OUT/fused_moe_combine_shapes_h200.json" ;;
    moewave) # session 36: ncu put the M = 8 / 16 gate-up at 1.8 / 2.4 active warps per scheduler
             # (7 / 5 programs an SM by shared memory, 480 programs at M = 8: half a wave), issuing
             # 0.53 a cycle and reading DRAM at 52-54 %. Tiles of 3 stages fit 10 programs an SM
             # (shared memory and registers, sm_90); live splits whose target fills about one
             # wave at M = 5-16 on random routing and splits deep on shared experts. The grid
             # against the table on 8 / 32 shared experts and random routing, then two trial
             # tables (bench_results/moe_trial_table_s36_{a,b}.json: bands 7 / 8 / 16) against
             # the shipped one and Marlin in one run
             step moe-wave-grid ${MOE_WAVE_LIMIT:-240} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_WAVE_MS:-5 7 8 9 12 16} --routings concentrated:8,concentrated:32,random \
               --grid "32,128,2,3,0,1,4,512;32,128,2,3,0,1,8,512;32,128,2,3,0,1,4,700;32,128,2,3,0,1,8,700;32,128,2,3,0,1,4,256;32,128,2,2,0,1,4,512" \
               --out "$OUT/fused_moe_wave_grid_h200.json"
             step moe-wave-bench ${MOE_BENCH_LIMIT:-200} python3 scripts/bench_fused_moe.py --check \
               --rounds 3 --baselines sglang_marlin --ms 1 5 8 9 12 16 32 \
               --ours-variants "a:SGLANG_DDTREE_MOE_CONFIG=$PWD/bench_results/moe_trial_table_s36_a.json" \
                 "b:SGLANG_DDTREE_MOE_CONFIG=$PWD/bench_results/moe_trial_table_s36_b.json" \
               --out "$OUT/fused_moe_wave_h200.json" ;;
    moencu)  # Nsight Compute on the fused MoE's launches at M = 8 / 16 (random routing, eager
             # calls, caches flushed by ncu between kernels): speed of light, occupancy, launch
             # and warp-state stats as CSV, where the small-M gate-up and down lose bandwidth
             step moencu ${MOENCU_LIMIT:-200} ncu --clock-control none \
               -k "regex:_prologue|_gate_up|_down|_combine" --launch-count ${MOENCU_LAUNCHES:-24} \
               --section SpeedOfLight --section Occupancy --section LaunchStats \
               --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
               --csv --page details --log-file "$OUT/ncu_fused_moe_h200.csv" \
               python3 scripts/bench_fused_moe.py --no-sglang --profile-ms ${MOENCU_MS:-8 16} \
               --layers 1 --out "$OUT/moencu.json"
             step moencu-summary 60 python3 scripts/ncu_details_summary.py \
               "$OUT/ncu_fused_moe_h200.csv" --out "$OUT/ncu_fused_moe_summary_h200.json" ;;
    moestall) # (session 52) Nsight Compute's warp-state samples per SASS instruction of the fused
             # MoE's gate-up and down (random routing, the third eager call of each M): why the
             # M = 8 gate-up issues on about half of its cycles (session 36's details page: 0.5
             # instructions a cycle a scheduler) when a 4-stage pipeline was no faster (session 45)
             for m in ${MOESTALL_MS:-8}; do
               for k in gate_up down_loop; do
                 step moestall-$k-m$m ${MOESTALL_LIMIT:-150} sh -c "ncu --clock-control none \
                   -k regex:_${k}_kernel --launch-skip 2 --launch-count 1 \
                   --section WarpStateStats --section SourceCounters --page source --csv \
                   --print-source sass python3 scripts/bench_fused_moe.py --no-sglang \
                   --profile-ms $m --layers 1 > $OUT/ncu_moe_${k}_m${m}_sass.csv"
               done
             done
             step moestall-summary 60 python3 scripts/ncu_sass_stalls.py "$OUT"/ncu_moe_*_sass.csv \
               --out "$OUT/ncu_moe_stalls_h200.json"
             gzip -f "$OUT"/ncu_moe_*_sass.csv ;;
    moepdl)  # (session 59) programmatic dependent launch (triton_kernels/moe_pdl.py; opt-in then):
             # whole calls of the table against waits only (1), each early release alone
             # (1:a grouping, 1:g gate-up, 1:d down) and all (2), each with and without x's
             # copy per chunk in the grouping, interleaved, 3 rounds, random routing then 8
             # shared experts; then the GPU test (each choice's bits equal plain launches,
             # eager and CUDA-graph replay). No kit
             # (and two tables whose looped downs hold fewer registers, ptxas's cap in
             # GemmConfig.max_regs: 72 where no spill, 7 programs an SM instead of 6; the
             # M = 8 band's at 64, 8 programs; the looped-down bands of M <= 48; written
             # here into $OUT)
             V="python3 scripts/moe_table_variant.py"; R="$OUT/moe_configs_down_regs"
             $V "${R}72.json" "2,4,7,8,16,32,48:down.max_regs=72" &&
             $V "${R}64.json" "2,4,7,16,32,48:down.max_regs=72" "8:down.max_regs=64"
             for routing in random concentrated:8; do
               step moepdl-${routing/:/} ${MOEPDL_LIMIT:-170} python3 scripts/bench_fused_moe.py \
                 --no-sglang --check --rounds 3 --routing $routing \
                 --ms ${MOEPDL_MS:-8 1 2 4 16 32 48 64} \
                 --ours-variants pdl1:SGLANG_DDTREE_MOE_PDL=1 pdl2:SGLANG_DDTREE_MOE_PDL=2 \
                   p1a:SGLANG_DDTREE_MOE_PDL=1:a p1g:SGLANG_DDTREE_MOE_PDL=1:g \
                   p1d:SGLANG_DDTREE_MOE_PDL=1:d chunks:SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_pdl1:SGLANG_DDTREE_MOE_PDL=1,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_pdl2:SGLANG_DDTREE_MOE_PDL=2,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_p1a:SGLANG_DDTREE_MOE_PDL=1:a,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_p1g:SGLANG_DDTREE_MOE_PDL=1:g,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_p1d:SGLANG_DDTREE_MOE_PDL=1:d,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   c_p1gd:SGLANG_DDTREE_MOE_PDL=1:gd,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                   r72:SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_down_regs72.json \
                   r64:SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_down_regs64.json \
                   r64_c_pdl1:SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_down_regs64.json,SGLANG_DDTREE_MOE_PDL=1,SGLANG_DDTREE_MOE_PROLOGUE=chunks \
                 --out "$OUT/fused_moe_pdl_${routing/:/}_h200.json"
             done
             step moepdl-test ${MOEPDL_TEST_LIMIT:-200} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "pdl_modes" ;;
    moepdlab) # (session 59) the served defaults since then (PDL 1:gd on sm_90+, x's copy per
             # chunk beside the one-program grouping) against plain launches with the copy per
             # row (before), the copy per chunk alone, and PDL with waits only; interleaved, 3
             # rounds, random routing then 8 shared experts; then the MoE GPU tests (on the new
             # defaults). No kit
             moe_ab moepdlab ${MOEPDL_LIMIT:-120} 3 "${MOEPDL_MS:-8 1 2 4 16 32 64}" fused_moe_pdl_ab \
               before:SGLANG_DDTREE_MOE_PDL=0,SGLANG_DDTREE_MOE_PROLOGUE=rows \
               chunks_only:SGLANG_DDTREE_MOE_PDL=0 waits_only:SGLANG_DDTREE_MOE_PDL=1
             step moepdlab-tests ${MOEPDL_TEST_LIMIT:-240} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "not sglang" ;;
    moeearly) # (session 60) moe_pdl's loads before the wait: the looped down's block, rows and
             # routing weights (e) and the combine's expert ids (c), served since c4d0f68
             # (1:gdec), against 1:gd and each alone; interleaved, random routing then 8 shared
             # experts; then the PDL GPU test (every mode's bits, eager and replayed). No kit.
             # (Run a timed 7913413's first form: weight tiles before the down's wait; run b
             # 9eb0c23's, against the then default 1:gd)
             moe_ab moeearly ${MOEEARLY_LIMIT:-150} ${MOEEARLY_ROUNDS:-3} "${MOEEARLY_MS:-8 1 2 4 16 32 64}" \
               fused_moe_early gd:SGLANG_DDTREE_MOE_PDL=1:gd e:SGLANG_DDTREE_MOE_PDL=1:gde \
               c:SGLANG_DDTREE_MOE_PDL=1:gdc
             step moeearly-test ${MOEEARLY_TEST_LIMIT:-150} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "pdl_modes" ;;
    moerows) # (session 60) MoeConfig.early_rows (the gate-up's block expert and rows in one
             # round of loads; the M = 8 band since c4d0f68) against the table without it (written
             # here), with the served PDL and with 1:gd; interleaved, random routing then 8
             # shared experts; then its GPU test (bits). No kit. (Run d timed 0401d49's form, an
             # env switch SGLANG_DDTREE_MOE_GU_ROWS, since replaced by the band field)
             python3 scripts/moe_table_variant.py "$OUT/moe_configs_no_early_rows.json" 8:early_rows=0
             moe_ab moerows ${MOEROWS_LIMIT:-150} ${MOEROWS_ROUNDS:-5} "${MOEROWS_MS:-8 1 2 4 16 32 64}" \
               fused_moe_rows "no_rows:SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_no_early_rows.json" \
               gd:SGLANG_DDTREE_MOE_PDL=1:gd \
               "gd_no_rows:SGLANG_DDTREE_MOE_PDL=1:gd,SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_no_early_rows.json"
             step moerows-test ${MOEROWS_TEST_LIMIT:-200} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py -k "rows_in_one or pdl_modes" ;;
    moes60ab) # (session 60) the served defaults since then (PDL 1:gdec: the down's and the
             # combine's loads before the wait; the M = 8 band's early_rows and 128-column down
             # ranges) against the ones before (PDL 1:gd,
             # bench_results/moe_w4a16_configs_before_s60.json), and the PDL and table changes
             # alone; interleaved, random routing then 8 shared experts; then the GPU tests of
             # PDL, early_rows, graph replays and live splits (bits). No kit. (Run e timed it
             # at c4d0f68, before the 128-column ranges: its rows_only is table_only there)
             moe_ab moes60ab ${MOES60AB_LIMIT:-150} ${MOES60AB_ROUNDS:-5} "${MOES60AB_MS:-8 1 2 4 16 32 64}" \
               fused_moe_s60_ab \
               "before:SGLANG_DDTREE_MOE_PDL=1:gd,SGLANG_DDTREE_MOE_CONFIG=$PWD/bench_results/moe_w4a16_configs_before_s60.json" \
               table_only:SGLANG_DDTREE_MOE_PDL=1:gd \
               "pdl_only:SGLANG_DDTREE_MOE_CONFIG=$PWD/bench_results/moe_w4a16_configs_before_s60.json"
             step moes60ab-tests ${MOES60AB_TEST_LIMIT:-200} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py \
               -k "pdl_modes or rows_in_one or graph_replay or live_split or serial" ;;
    moem8pdl) # (session 60) the M = 8 band's tiles re-timed under the served PDL (1:gdec):
             # tables written here from the table as this card is served it (session 61: the
             # H100's overrides give its M = 8 down 128 columns, other cards 256), each changing
             # one field of that band (down n_per_cta 128 / 256 / 512, one of the first two the
             # table itself, down block_n 32, gate-up split_target 512, gate-up 4 stages), whole
             # calls at M = 8, interleaved, 7 rounds, random routing then 8 shared experts. No
             # kit. (Run f timed it at b0356b6, whose table had 256 down columns, without dn128)
             V="python3 scripts/moe_table_variant.py"; T="$OUT/moe_configs_m8"
             $V "${T}_dn512.json" 8:down.n_per_cta=512 && $V "${T}_dn256.json" 8:down.n_per_cta=256 &&
             $V "${T}_dn128.json" 8:down.n_per_cta=128 && $V "${T}_dnbn32.json" 8:down.block_n=32 &&
             $V "${T}_gut512.json" 8:gate_up.split_target=512 &&
             $V "${T}_gus4.json" 8:gate_up.num_stages=4
             moe_ab moem8pdl ${MOEM8PDL_LIMIT:-150} ${MOEM8PDL_ROUNDS:-7} 8 fused_moe_m8_pdl \
               $(for n in dn512 dn256 dn128 dnbn32 gut512 gus4; do
                   printf '%s:SGLANG_DDTREE_MOE_CONFIG=%s ' $n "$OUT/moe_configs_m8_$n.json"; done) ;;
    moebm32) # (session 68) 32-row expert blocks at M 17-48, which since session 68 narrow to
             # 8-row tiles (experts of 1-8 rows, as the served 16-row blocks' half does), 16-row
             # ones (9-16 rows) or run whole (17-32 rows: each weight tile dequantized once for
             # all of them, where the served 16-row blocks dequantize it twice): tables written
             # here from the table as this card is served it: the M 17-32 band on 32-row
             # blocks with its gate-up tile (bm32: sm_90 compile 221 registers and 86,016
             # bytes of shared memory, 2 programs an SM, where the served 16-row blocks' take
             # 165 and 61,440, 3), without par_acc on 2 stages (bm32lean: 168 / 51,200, 3), or
             # on 128-deep K steps (bm32k128: 128 / 43,008, 4); and the M 17-32 and 33-48
             # bands as bm32lean (bm32b48). Whole calls at M = 17 / 24 / 32 / 40 / 48,
             # interleaved, 5 rounds, on 8 / 32 shared experts and random routing. No kit
             V="python3 scripts/moe_table_variant.py"; B32="block_m=32,half_m=1"
             LEAN="gate_up.par_acc=0,gate_up.num_stages=2"  # sm_90: 168 registers, 51,200 bytes
             $V "$OUT/t_bm32.json" "32:$B32" && $V "$OUT/t_bm32lean.json" "32:$B32,$LEAN" &&
             $V "$OUT/t_bm32k128.json" "32:$B32,gate_up.par_acc=0,gate_up.block_k=128" &&
             $V "$OUT/t_bm32b48.json" "32,48:$B32,$LEAN"
             ROUTINGS="${MOEBM32_ROUTINGS:-concentrated:8 concentrated:32 random}" \
               moe_ab moebm32 ${MOEBM32_LIMIT:-120} ${MOEBM32_ROUNDS:-5} "17 24 32 40 48" \
               fused_moe_bm32 $(for n in bm32 bm32lean bm32k128 bm32b48; do
                   printf '%s:SGLANG_DDTREE_MOE_CONFIG=%s ' $n "$OUT/t_$n.json"; done)
             rm -f "$OUT"/t_bm32*.json ;;
    moem28)  # (session 70) the table as the H100 serves it since session 70 (bm32a: M 28-32
             # on 32-row blocks, the gate-up's K split up to 7 ways at split_target 448, the
             # looped down split live at 896) against the bands as written (s69: 16-row blocks
             # at M 17-32, what every other card serves), both written here from the shipped
             # table, so that one of the two is the served table on an H100 and the other on
             # an H200. Whole calls at M 24-32, interleaved, 7 rounds, on random routing and
             # 32 / 8 shared experts. No kit
             V="python3 scripts/moe_table_variant.py"
             $V "$OUT/t_bm32a.json" --device "NVIDIA H100 80GB HBM3" &&
             $V "$OUT/t_s69.json" --device ""
             ROUTINGS="${MOEM28_ROUTINGS:-random concentrated:32 concentrated:8}" \
               moe_ab moem28 ${MOEM28_LIMIT:-150} ${MOEM28_ROUNDS:-7} "24 26 27 28 30 32" \
               fused_moe_m28 bm32a:SGLANG_DDTREE_MOE_CONFIG="$OUT/t_bm32a.json" \
               s69:SGLANG_DDTREE_MOE_CONFIG="$OUT/t_s69.json"
             rm -f "$OUT"/t_bm32a.json "$OUT"/t_s69.json ;;
    moegoal) # (session 66) the fused-MoE bandwidth goal (issue 5) as served: whole calls at
             # M = 8 / 16 / 32 / 64 (the goal's: random routing), MOEGOAL_ROUNDS rounds, each
             # row's GB/s against the copy bandwidth measured in the same run. No kit. Random
             # routing only, with the M = 8 band's tiles beside it:
             # ROUTINGS=random gpu_session.sh moegoal moem8pdl (set up for the H200; none came)
             moe_ab moegoal ${MOEGOAL_LIMIT:-150} ${MOEGOAL_ROUNDS:-7} "8 16 32 64" fused_moe_goal ;;
    gemmlt)  # (session 67) the Kimi rank's dense GEMMs (x @ w.T as SGLang's linear layers call
             # it) on cuBLAS against cuBLASLt (torch's preferred BLAS library; a server takes it
             # from TORCH_BLAS_PREFER_CUBLASLT=1) and our skinny GEMM, at a decode step's and
             # a tree verify's rows. No kit. If cuBLASLt is faster at 16-32 rows and no slower
             # at 1, the cost curve with --server-env TORCH_BLAS_PREFER_CUBLASLT=1 (every server).
             # Session 67, an H100: within 0.7 us of cuBLAS at every shape and row count, so
             # that cost curve was not run (bench_results/gemm_cublaslt_h100_s67.json)
             step gemm-lt ${GEMMLT_LIMIT:-240} python3 scripts/bench_skinny_gemm.py --cublaslt \
               --ms ${GEMMLT_MS:-1 8 16 32 33} --rounds ${GEMMLT_ROUNDS:-3} \
               --out "$OUT/gemm_cublaslt_h200.json" ;;
    gemmsmall) # (session 67) where a decode's GEMMs run SGLang's kernels for up to 16 tokens and
             # a 32-token verify's run cuBLAS: the q / kv down-projection and q_b_proj
             # (dsv3_fused_a_gemm) and the router (dsv3_router_gemm, fp32 out) against cuBLAS,
             # cuBLASLt and our skinny GEMM at 1-33 rows. Needs the kit (SGLang's kernels)
             # (session 68: with ours under PDL beside them, --pdl)
             step gemm-fused-a ${GEMMSMALL_LIMIT:-150} python3 scripts/bench_skinny_gemm.py \
               --sglang-fused-a --cublaslt --pdl --shapes 2112x7168,1536x1536 \
               --ms 1 8 16 17 32 --out "$OUT/gemm_small_fused_a_h200.json"
             step gemm-router ${GEMMSMALL_LIMIT:-150} python3 scripts/bench_skinny_gemm.py \
               --sglang-router --fp32-out --pdl --shapes 384x7168 --ms 1 8 16 17 32 \
               --out "$OUT/gemm_small_router_h200.json" ;;
    gemmpdl) # (session 68) the skinny GEMM with programmatic dependent launch (--pdl:
             # skinny_gemm.pdl_mode 1) against plain launches and cuBLAS, at the shapes the
             # switches serve (the q / kv down-projection, the shared expert's gate-up and down,
             # the router with fp32 out), 1-32 rows; outputs checked for the plain launches'
             # bits. No kit (gemmsmall adds SGLang's 16-token kernels). Session 68 ran it with
             # a mode 2 since removed (bench_results/skinny_pdl_*_h100_s68.json)
             step gemm-pdl ${GEMMPDL_LIMIT:-150} python3 scripts/bench_skinny_gemm.py --pdl \
               --shapes 2112x7168,512x7168,7168x256 --ms 1 8 16 17 24 32 \
               --out "$OUT/skinny_pdl_h200.json"
             step gemm-pdl-router ${GEMMPDL_LIMIT:-150} python3 scripts/bench_skinny_gemm.py \
               --pdl --fp32-out --shapes 384x7168 --ms 1 8 16 17 24 32 \
               --out "$OUT/skinny_pdl_router_h200.json" ;;
    moem16split) # (session 61) the M 9-16 band's gate-up K split: split_k 4 (the bands') and
             # 7 (a divisor of its 28 K steps) with split_target 512 / 448 / 384, in tables
             # written here from the table as this card is served it (on the H100 its override
             # has 7 / 448: there s7t448 is the table itself, elsewhere s4); whole calls at M = 9 / 12 / 16,
             # interleaved, 5 rounds, on 8 / 32 / 16 shared experts and random routing. No kit.
             # (Session 61 ran these commands on an H100 at 5e17a73, before the override:
             # bench_results/fused_moe_split7t_*_h100_s61.json)
             V="python3 scripts/moe_table_variant.py"; G="16:gate_up.split_k"
             $V "$OUT/t_s4.json" "$G=4,gate_up.split_target=512" &&
             $V "$OUT/t_s7.json" "$G=7,gate_up.split_target=512" &&
             $V "$OUT/t_s7t448.json" "$G=7,gate_up.split_target=448" &&
             $V "$OUT/t_s7t384.json" "$G=7,gate_up.split_target=384"
             ROUTINGS="concentrated:8 concentrated:32 concentrated:16 random" \
               moe_ab moem16split ${MOEM16SPLIT_LIMIT:-90} 5 "9 12 16" fused_moe_split7t \
               $(for n in s4 s7 s7t448 s7t384; do
                   printf '%s:SGLANG_DDTREE_MOE_CONFIG=%s ' $n "$OUT/t_$n.json"; done)
             rm -f "$OUT"/t_s[47]*.json ;;
    moetableab) # (session 55) whole calls of the committed table against another one in the
             # same run, interleaved, 3 rounds, on three routings (default: the table before
             # session 55's scale_once / par_acc picks, bench_results/moe_w4a16_configs_before_s55.json);
             # then the M 17-32 band's looped down with scale_once per kernel on the three
             # routings (session 55 timed it at M = 32 on random routing only: 59.8 -> 52.6 us).
             # Default limits sum to 390 s, no kit
             for routing in random concentrated:8 concentrated:32; do
               step moetableab-${routing/:/} ${MOETABLEAB_LIMIT:-100} python3 scripts/bench_fused_moe.py \
                 --no-sglang --check --rounds 3 --routing $routing \
                 --ms ${MOETABLEAB_MS:-1 2 3 4 6 8 9 12 16 17 24 32 40 48 64} \
                 --ours-variants "old:SGLANG_DDTREE_MOE_CONFIG=$PWD/${MOE_OLD_TABLE:-bench_results/moe_w4a16_configs_before_s55.json}" \
                 --out "$OUT/fused_moe_table_ab_${routing/:/}_h200.json"
             done
             for routing in random concentrated:8 concentrated:32; do
               step moedownso-${routing/:/} ${MOEDOWNSO_LIMIT:-30} python3 scripts/bench_fused_moe.py \
                 --no-sglang --ms ${MOEDOWNSO_MS:-17 24 32} --routing $routing --breakdown \
                 --breakdown-down "64,256,4,3,512;64,256,4,3,512,0,1,0,0,1" \
                 --out "$OUT/fused_moe_down_so_${routing/:/}_h200.json"
             done ;;
    moepar)  # (session 52) GemmConfig.par_acc (nibble planes 0-3 and 4-7 summed in two
             # accumulators: half-length MMA chains) and scale_once (a group's scale loaded once:
             # 26 against 32 KB of shared memory on the M = 8 tile, so 8 programs an SM and a
             # one-wave split 2 at M = 8); bench_results/moe_variant_sass_s52.json has their
             # static SASS (with both, the dequant in one piece, split_dq 0, keeps 127
             # registers at the 8-long chain; 128-row K steps: a 4-long chain, 80 registers). First their GPU tests, then whole calls against the table's own
             # tiles with and without them: 8-row blocks at M 2-16 and 16-row half_m blocks at
             # M 9-48 (at M 9-16 against the table's 8-row blocks: the 16-row ones dequantize
             # an expert's weights once where its tokens share it, as the Kimi emulation's
             # dummy routing does), three routings (the candidates repeat the table's tiles so
             # that the table column and the plain candidate are two timings of the same
             # launch: the run's noise). Default limits sum to 540 s, inside one 600 s call
             # (a grid saves after every row, so a step cut short keeps its rows)
             step moepar-test ${MOEPAR_TEST_LIMIT:-120} python3 -m pytest -q \
               tests/gpu/test_moe_w4a16_gpu.py -k "two_accumulator or scales_once"
             step moepar-bm8 ${MOEPAR_BM8_LIMIT:-180} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOEPAR_MS:-8 2 4 7 9 12 16} --routings random,concentrated:8,concentrated:32 \
               --grid-block-m 8 --grid "${MOEPAR_GRID:-32,256,2,3,0,1,4,256;64,256,4,3,0,1,4,512,0,1,96;32,256,2,3,0,1,4,256,1;32,256,2,3,0,1,4,256,0,1;32,256,2,3,0,1,4,256,1,1;32,256,2,3,0,0,4,256,1,1;32,128,2,4,0,1,4,256,1,1;32,256,2,3,0,1,2,0,0,1;32,256,2,3,0,1,4;32,256,2,3,0,1,4,0,1;64,256,4,3,0,1,4,512;64,256,4,3,0,1,4,512,1;64,256,4,3,0,1,4,512,0,1;64,256,4,3,0,1,4,512,1,1}" \
               --out "$OUT/fused_moe_par_acc_bm8_grid_h200.json"
             step moepar-half16 ${MOEPAR_LIMIT:-120} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOEPAR_HALF_MS:-9 12 16 17 24 32 33 48} --routings random,concentrated:8,concentrated:32 \
               --grid-block-m 16 --grid-half-m 1 --grid "${MOEPAR_HALF_GRID:-64,256,4,3,0,1,4,512;64,256,4,3,0,1,4,512,1;64,256,4,3,0,1,4,512,0,1;64,256,4,3,0,1,4,512,1,1;64,256,4,3,0,1,2,512;64,256,4,3,0,1,2,512,0,1}" \
               --out "$OUT/fused_moe_par_acc_half16_grid_h200.json"
             # the looped down with it, per kernel (random routing): the M = 8, 9-16 and 17-48
             # bands' down tiles with and without; first (session 53) register limits that fit
             # 7-8 programs an SM (64-72 registers, no spill; 6 at 80): the M = 8 call's ~854
             # 512-column programs in one wave (1.08 waves at 6). The bm8 grid's second
             # candidate: the M 9-16 tile at 96 registers (5 programs, a small spill)
             step moepar-down ${MOEPAR_LIMIT:-120} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOEPAR_DOWN_MS:-8 16 32} --breakdown --breakdown-down "${MOEPAR_DOWN:-64,256,4,3,256;64,256,4,3,512,0,1,0,0,1,64;64,256,4,3,512,0,1,0,0,0,72;64,256,4,3,256,0,1,0,0,1,64;64,256,4,3,256,0,1,0,1;64,256,4,3,256,0,1,0,0,1;64,256,4,3,256,0,1,0,1,1;64,256,4,3,512,0,1,896;64,256,4,3,512,0,1,896,1;64,256,4,3,512,0,1,896,0,1;64,256,4,3,512;64,256,4,3,512,0,1,0,1;64,256,4,3,512,0,1,0,0,1}" \
               --out "$OUT/fused_moe_par_acc_down_h200.json" ;;
    moewide) # (session 53) MoeConfig.wide_halves: 16-row half_m blocks whose full blocks run
             # the gate-up as two half-width tiles, so the kernel keeps the 8-row tile's
             # registers and shared memory (sm_90: 130 / 56 KB against plain half_m's 167 /
             # 72 KB, which cost it 2 % on random routing and 7 % on 32 shared experts at
             # M = 9 in session 47) while an expert of 9-16 rows (the Kimi emulation's dummy
             # fill at budgets 8-15) is dequantized once; with GemmConfig.max_regs 128 (the
             # 11th field) it compiles to 128 registers, 4 programs an SM as the 8-row tile,
             # where 130 allow 3. Its GPU tests, then whole calls at the
             # M 9-48 bands against the table on three routings: half_m 2 (the down on full
             # blocks) and 1 with wide_halves, and half_m 1 without it (the M 17-48 bands' own).
             # Default limits sum to 540 s, inside one 600 s call
             step moewide-test ${MOEWIDE_TEST_LIMIT:-120} python3 -m pytest -q \
               tests/gpu/test_moe_w4a16_gpu.py -k "wide_halves"
             for half in ${MOEWIDE_HALF:-2 1}; do
               step moewide-h$half ${MOEWIDE_LIMIT:-140} python3 scripts/bench_fused_moe.py \
                 --no-sglang --ms ${MOEWIDE_MS:-9 12 16 17 24 32 40 48} \
                 --routings random,concentrated:8,concentrated:32 --grid-block-m 16 \
                 --grid-half-m $half --grid-wide-halves \
                 --grid "${MOEWIDE_GRID:-64,256,4,3,0,1,4,512;64,256,4,3,0,1,4,512,0,0,128;64,256,4,3,0,1,2,512;64,256,4,3,0,1,4,256,0,0,128}" \
                 --out "$OUT/fused_moe_wide_halves_h${half}_grid_h200.json"
             done
             step moewide-h1-plain ${MOEWIDE_LIMIT:-140} python3 scripts/bench_fused_moe.py \
               --no-sglang --ms ${MOEWIDE_MS:-9 12 16 17 24 32 40 48} \
               --routings random,concentrated:8,concentrated:32 --grid-block-m 16 --grid-half-m 1 \
               --grid "${MOEWIDE_PLAIN_GRID:-64,256,4,3,0,1,4,512;64,256,4,3,0,1,2,512;64,256,4,3,0,1,4,256}" \
               --out "$OUT/fused_moe_half_m16_plain_grid_h200.json" ;;
    moeserve) # the int4 Kimi rank on our fused MoE, DDTREE against AR token for token, at
             # budgets and batch sizes whose MoE calls take the M 5-7 band (session 26):
             # budget 4 / 6 at batch 1 (M = 5 / 7), AR and the draft-free decode at batch 6
             step moe-serve ${MOE_SERVE_LIMIT:-420} python3 scripts/e2e_lossless.py \
               --cases "${MOE_SERVE_CASES:-kimi_int4:4,6,8}" --batch-sizes ${MOE_SERVE_BATCHES:-1,6} --prompts 12 \
               --eager-check= --speed= --deterministic= --out "$OUT/e2e_lossless_kimi_int4_h200.json" \
               ${MOE_SERVE_ARGS:-$card_serve_args} ;;
    moehalf) # MoeConfig.half_m: 32-row blocks run as 16-row tiles while their second half is
             # padding, so an expert with 17-32 rows of a call dequantizes each weight tile once
             # (a tree's tokens that share experts; the dummy fill's 8 experts), against the
             # table's 16-row blocks, at the M 9-64 bands' gate-up configs
             # (block_m 64: 4-warp gate-up tiles only; 2 warps at 32 x 256 spill there)
             # (session 46: block_m 16 too, 8-row tiles for experts of up to 8 rows;
             # MOE_HALF_MODE 2 narrows the gate-up only, files *_gu_*)
             for bm in ${MOE_HALF_BLOCK_M:-32 64}; do
               for mode in ${MOE_HALF_MODE:-1}; do
               tag=$bm$([ "$mode" = 2 ] && echo _gu)
               step moe-half-$tag ${MOE_HALF_LIMIT:-200} python3 scripts/bench_fused_moe.py \
                 --no-sglang --ms ${MOE_HALF_MS:-9 16 17 24 32 33 48 64} \
                 --routings concentrated:8,concentrated:32,random --grid-block-m $bm --grid-half-m $mode \
                 --grid "${MOE_HALF_GRID:-32,256,4,3,0,1,4;64,256,4,3,0,1,2;64,256,4,3,0,1,1;64,256,4,3,0,1,4}" \
                 --out "$OUT/fused_moe_half_m${tag}_grid_h200.json"
               done
             done ;;
    moebm8)  # 8-row expert blocks (the MMA's n = 8): half the activation tile, MMAs and shared
             # memory of the 16-row blocks at calls whose experts hold one or two rows each;
             # the table's gate-up tiles (and its down tiles) run with block_m 8 against the table
             step moe-bm8 ${MOE_BM8_LIMIT:-420} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_BM8_MS:-8 16 32 64 128 1} --routings ${MOE_BM8_ROUTINGS:-random,concentrated:8} \
               --grid-block-m 8 --grid "${MOE_BM8_GRID:-32,128,2,4,0,1,4,256;32,128,2,4,0,1,4;32,128,2,4,0,1,1;32,128,2,6,0,1,4,256;32,256,2,3,0,1,4;32,256,2,3,0,1,1;32,128,2,4,0,1,8;64,256,4,3,0,1,4,512;64,256,4,3,0,1,4,256;64,256,4,3,0,1,2;64,256,4,3,0,1,1}" \
               --out "$OUT/fused_moe_bm8_grid_h200.json" ;;
    moebm8wide) # block_m 8 per band: gate-up candidates over each band's M on three routings,
             # then the down candidates per kernel (--breakdown) under MOE_BM8_TABLE (default the
             # shipped table; session 45 ran it with a copy whose M 2-128 bands had block_m 8)
             step moe-bm8-grid ${MOE_BM8_LIMIT:-330} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_BM8_MS:-8 16 2 4 7 9 12 24 32 17 48 64 33 96 128 65} \
               --routings random,concentrated:8,concentrated:32 --grid-block-m 8 \
               --grid "${MOE_BM8_GRID:-32,256,2,3,0,1,1;32,256,2,3,0,1,4;32,256,2,3,0,1,4,256;32,256,2,3,0,1,4,512;32,256,2,3,0,1,7,512;32,256,2,4,0,1,1;32,256,2,3,0,0,1;32,128,2,4,0,1,4,256;32,128,2,4,0,1,8;32,128,2,4,0,1,8,512;64,256,4,3,0,1,1;64,256,4,3,0,1,2;64,256,4,3,0,1,4,512;64,256,4,3,0,1,4,256;16,256,1,4,0,1,1}" \
               --out "$OUT/fused_moe_bm8_wide_grid_h200.json"
             for r in random concentrated:8; do
               step moe-bm8-down-${r%%:*} ${MOE_BM8_DOWN_LIMIT:-110} python3 scripts/bench_fused_moe.py \
                 --no-sglang --breakdown --config "${MOE_BM8_TABLE:-triton_kernels/moe_w4a16_configs.json}" --routing $r \
                 --ms ${MOE_BM8_DOWN_MS:-8 16 32 64 128} --out "$OUT/fused_moe_bm8_down_${r%%:*}_h200.json"
             done ;;
    moebm8check) # the GPU MoE tests that take the table's configs at M <= 64 (8-row blocks at
             # M 2-16 since session 45), not run in session 45
             # (session 46: and the half_m blocks, 16-row ones at M 17-48 since then)
             step moe-bm8-check ${MOE_BM8_CHECK_LIMIT:-300} python3 -m pytest -q tests/gpu/test_moe_w4a16_gpu.py \
               -k "serial_split_k_equals or live_split_follows or kimi_shapes or half_m_blocks" ;;
    moedownwave) # (session 46; run in session 47) issue 5's bandwidth at M = 8: the down kernel reads
             # its weights at 62 % of copy there (854 programs, about 1.3 waves, at the table's
             # 512-column ranges); narrower / other ranges and stages against the table's, per
             # kernel (--breakdown), at M = 8 / 16 / 32
             step moe-down-wave ${MOE_DOWN_WAVE_LIMIT:-240} python3 scripts/bench_fused_moe.py \
               --no-sglang --breakdown --ms ${MOE_DOWN_WAVE_MS:-8 16 32} --breakdown-down \
               "${MOE_DOWN_WAVE:-64,256,4,3,256;64,256,4,4,256;64,256,4,3,448;32,256,2,3,256;32,256,2,3,448;64,256,4,4,512;64,256,4,3,896}" \
               --out "$OUT/fused_moe_down_wave_h200.json" ;;
    moelivedown) # (session 47) live down column ranges (the down config's split_target): the
             # band's looped down tile with ranges chosen per call from the used-block count,
             # against the table's and a fixed 256-column range, per kernel (--breakdown), at
             # M 1-128 on random routing and 8 / 32 shared experts (the dummy fill's 8)
             for r in ${MOE_LIVE_DOWN_ROUTINGS:-random concentrated:8 concentrated:32}; do
               step "moe-live-down-$r" ${MOE_LIVE_DOWN_LIMIT:-200} python3 scripts/bench_fused_moe.py \
                 --no-sglang --breakdown --routing "$r" --ms ${MOE_LIVE_DOWN_MS:-1 2 4 6 8 12 16 24 32 48 64 96 128} \
                 --breakdown-down "${MOE_LIVE_DOWN:-64,256,4,3,256;64,256,4,3,512,0,1,896;64,256,4,3,512,0,1,1792;64,256,4,3,256,0,1,896;64,256,4,3,256,0,1,1792;64,256,4,3,512,0,1,448;32,256,2,3,448,0,1,896}" \
                 --out "$OUT/fused_moe_live_down_${r/:/_}_h200.json"
             done ;;
    moesmall) # (session 48) the one-program grouping of small calls (moe_align method small:
             # a histogram and a sort, no per-expert programs) at M 1-16: the GPU test file (also
             # re-runs session 47's commits), the prologue alone against the one-launch
             # grouping, then whole calls with it against the shipped grouping, on random
             # routing and on the dummy fill's 8 shared experts
             step moe-small-tests ${MOE_SMALL_TEST_LIMIT:-240} python3 -m pytest -q \
               tests/gpu/test_moe_w4a16_gpu.py -k "${MOE_SMALL_TESTS:-not sglang}"
             # (MOE_SMALL_PROLOGUE=0 skips the prologue; MOE_SMALL_VARIANT: the A/B's other side,
             # e.g. one:SGLANG_DDTREE_MOE_ALIGN=one once auto takes the small grouping)
             [ "${MOE_SMALL_PROLOGUE:-1}" = 0 ] || step moe-small-prologue ${MOE_SMALL_PROLOGUE_LIMIT:-120} \
               python3 scripts/bench_fused_moe.py --no-sglang --prologue --ms ${MOE_SMALL_MS:-1 2 4 8 16} \
               --routings concentrated:8,random --out "$OUT/fused_moe_small_prologue_h200.json"
             for r in random concentrated:8; do
               step "moe-small-$r" ${MOE_SMALL_LIMIT:-150} python3 scripts/bench_fused_moe.py --no-sglang \
                 --rounds 3 --routing "$r" --ms ${MOE_SMALL_MS:-1 2 4 8 16} \
                 --ours-variants ${MOE_SMALL_VARIANT:-small:SGLANG_DDTREE_MOE_ALIGN=small} \
                 --out "$OUT/fused_moe_small_ab_${r/:/_}_h200.json"
             done ;;
    moewarps) # (session 49, written without a GPU) fewer warps a program at M <= 16, never
             # timed before: gate-up programs of one warp and 16 columns (twice the programs of
             # the table's 2-warp 32-column tiles, the same loop a warp: 689 SASS instructions a
             # K step either way, 128 registers, 20 KB shared against 32 KB; sm_90 compile, no
             # spills) against the table, then down ranges of 2 / 1 warps at M = 8 / 16
             step moe-warps-grid ${MOE_WARPS_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang \
               --ms ${MOE_WARPS_MS:-2 4 8 9 12 16} --routings concentrated:8,concentrated:32,random \
               --grid "${MOE_WARPS_GRID:-16,256,1,3,0,1,4,512;16,256,1,4,0,1,4,512;16,256,1,3,0,1,4,1024;16,128,1,4,0,1,8,512}" \
               --out "$OUT/fused_moe_warps_grid_h200.json"
             for r in random concentrated:8; do
               step "moe-warps-down-$r" ${MOE_WARPS_LIMIT:-300} python3 scripts/bench_fused_moe.py --no-sglang \
                 --breakdown --ms 8 16 --routing "$r" \
                 --breakdown-down "${MOE_WARPS_DOWN:-64,256,4,3,256;32,256,2,3,128;32,256,2,3,256;16,256,1,3,128;32,256,2,4,128}" \
                 --out "$OUT/fused_moe_warps_down_${r/:/_}_h200.json"
             done ;;
    moem9)   # (session 47) M = 9 (budget 8 at batch 1, AR at batch 9): 16-row blocks that narrow
             # to 8 rows (half_m 1), so the dummy fill's 8 experts of 9 rows each take one
             # block, not two 8-row ones, against the table's 8-row blocks; two runs
             for run in a b; do
               step moe-m9-$run ${MOE_M9_LIMIT:-150} python3 scripts/bench_fused_moe.py --no-sglang \
                 --ms ${MOE_M9_MS:-9 10} --routings concentrated:8,concentrated:32,random \
                 --grid-block-m 16 --grid-half-m 1 \
                 --grid "${MOE_M9_GRID:-64,256,4,3,0,1,4,512;32,256,2,3,0,1,4,512;32,256,2,3,0,1,4;64,256,4,3,0,1,7,512;32,128,2,4,0,1,8,512;64,256,4,3,0,1,2,512}" \
                 --out "$OUT/fused_moe_m9_half_m16_${run}_grid_h200.json"
             done ;;
    mlareduce) # the MLA split reduce's splits per step (8 served) against 16 / 32 / 64, as
             # session 25 found for 128-dim rows; planned for a long-context server
             step mla-reduce ${MLA_REDUCE_LIMIT:-240} python3 scripts/bench_tree_verify.py \
               --kinds mla --no-baselines --batch-sizes 1,8,32 --budgets 8,16,32 \
               --contexts 2048,16384,65536 --plan-context 262144 --reduce-chunks 8,16,32,64 \
               --out "$OUT/tree_verify_mla_reduce_h200.json" ;;
    fa3)     # issue 4's grid with the fa3 column: needs flash_ops installed into /tmp/site first
             # (scripts/devkit_fa3.py install, one call per part, after the kit's chunks)
             step fa3-import 60 python3 -c "from sgl_kernel.flash_attn import flash_attn_with_kvcache; print('fa3 importable')"
             step fa3-bench ${FA3_LIMIT:-480} python3 scripts/bench_tree_verify.py \
               --out "$OUT/tree_verify_fa3_h200.json" ${FA3_ARGS:-} ;;
    tvwide) # session 33: fa3 beat ours past 2k keys (tree_verify_h200.json, session 33: MLA
             # 0.38-0.64x at 16k / 64k); 8-warp 64-row MLA tiles (wgmma, not the served 32-row
             # tile's mma.sync) and wider MHA tiles against the served ones and fa3, same call
             step tvwide-mla ${TVWIDE_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-sglang-triton --sweep "${TVWIDE_MLA:-64,64,8,2;64,32,8,2}" \
               --out "$OUT/tree_verify_wide_mla_h200.json" ${TVWIDE_ARGS:-}
             step tvwide-mha ${TVWIDE_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mha \
               --no-sglang-triton --sweep "${TVWIDE_MHA:-128,128,8,2;64,128,4,2;128,64,8,2}" \
               --out "$OUT/tree_verify_wide_mha_h200.json" ${TVWIDE_ARGS:-} ;;
    tvwidecheck) # the 8-warp MLA tile served (budget >= 33; 32 at batch >= 8; Hopper): issue 4's
             # MLA grid with our served kernel, the prefix on FlashMLA and fa3 in one run; the
             # doctor at the budgets it serves; DDTREE against AR token for token at 32 / 63
             step tvwide-bench ${TVWIDE_BENCH_LIMIT:-170} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-sglang-triton --mla-prefix --out "$OUT/tree_verify_fa3_fmla_mla_h200.json"
             step tvwide-doctor ${TVWIDE_DOCTOR_LIMIT:-120} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mla,mla_fp8 --budgets 32,33,63,64,128 --out "$OUT/doctor_graphs_wide_h200.json"
             step tvwide-e2e ${TVWIDE_E2E_LIMIT:-200} python3 scripts/e2e_lossless.py --cases mla:32,63 \
               --batch-sizes 1,8 --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_mla_wide_h200.json" ;;
    fmlabatch) # SGLANG_DDTREE_MLA_PREFIX=flashmla:8 (session 33, CPU-tested): the MLA + MoE
             # target on 64-token pages, DDTREE against AR token for token at batch 1 (our
             # kernel alone) and 8 (the prefix on FlashMLA), budgets 16 / 32
             step fmla-batch ${FMLA_BATCH_LIMIT:-300} python3 scripts/e2e_lossless.py --cases mla_fmla8:16,32 \
               --batch-sizes 1,8 --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_mla_fmla_batch_h200.json" ;;
    tvncu)   # Nsight Compute (if it reads the counters here: KINDS.md) on one issue-4 point each,
             # ours against fa3, where fa3 stays at the memory floor and ours does not (session
             # 33): MHA batch 8 / budget 16 / 64k keys, MLA batch 8 / budget 32 / 16k keys.
             # Needs FA3's parts installed. Speed-of-light, warp stalls, memory and compute
             # sections as CSV; no --clock-control (METHOD.md: leave the clocks alone)
             for pt in "mha 65536 16" "mla 16384 32"; do
               read -r kind ctx bud <<< "$pt"
               # demangled names: fa3's kernels are cutlass::device_kernel<flash::...> templates,
               # whose plain function name ("device_kernel") the regex would not match; ours come
               # first in the script (warm-up + 3 replays), then fa3's prefix, tree and merge passes
               step tvncu-$kind ${TVNCU_LIMIT:-240} ncu --clock-control none --graph-profiling node \
                 --kernel-name-base demangled -k "regex:tree_attn|flash" \
                 --launch-count ${TVNCU_LAUNCHES:-24} \
                 --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
                 --section MemoryWorkloadAnalysis --section Occupancy --csv --page details \
                 --log-file "$OUT/ncu_tree_verify_${kind}_h200.csv" \
                 python3 scripts/bench_tree_verify.py --kinds $kind --batch-sizes 8 --budgets $bud \
                 --contexts $ctx --iters 3 --no-sglang-triton --out "$OUT/tree_verify_ncu_${kind}_h200.json"
             done ;;
    tvtail)  # MHA trees of k x 64 (or 128) rows plus one group (budget 16 / 32 / 64 at 4 query
             # heads per KV head: 68 / 132 / 260 rows) with the leftover rows in a 16-row tail
             # tile of the last block (KernelConfig.tail_m) against the served tiles and fa3,
             # split counts as planned for each (session 34: ncu showed the 4-row second block
             # of budget 16 doubling the instructions per key of fa3's one 128-row tile)
             step tvtail ${TVTAIL_LIMIT:-420} python3 scripts/bench_tree_verify.py --kinds mha \
               --no-sglang-triton --budgets ${TVTAIL_BUDGETS:-16,32,64} \
               --sweep "${TVTAIL_SWEEP:-64,64,4,3,1,0,256,16;64,64,4,2,1,0,256,16;128,64,8,3,1,0,256,16;128,64,8,2,1,0,256,16}" \
               --out "$OUT/tree_verify_tail_mha_h200.json" ${TVTAIL_ARGS:-} ;;
    fa3prefix) # SGLANG_DDTREE_MHA_PREFIX=fa3 (session 34, CPU-tested): FA3's prefix contract and
             # the merged kernel eager / graph (GPU tests), issue 4's MHA grid with the
             # FA3-prefix column beside ours and fa3's tree verify, and DDTREE against AR token
             # for token on the tiny pair on the fa3 backend (fa3 at every batch; fa3:4)
             step fa3p-tests ${FA3P_TEST_LIMIT:-180} python3 -m pytest -q tests/gpu/test_mha_prefix_gpu.py
             step fa3p-bench ${FA3P_BENCH_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mha \
               --no-sglang-triton --mha-prefix --out "$OUT/tree_verify_fa3_prefix_mha_h200.json" \
               ${FA3P_BENCH_ARGS:-}
             step fa3p-e2e ${FA3P_E2E_LIMIT:-300} python3 scripts/e2e_lossless.py \
               --cases "${FA3P_CASES:-tiny_fa3p:8,16,32;tiny_fa3p4:16}" --batch-sizes 1,4 \
               --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_tiny_fa3_prefix_h200.json" ;;
    prefixauto) # the defaults since session 34 (SGLANG_DDTREE_MHA_PREFIX / MLA_PREFIX unset =
             # auto): the doctor's mha_fa3 rows (the prefix on FA3, graph == eager, against the
             # fp32 reference), then DDTREE against AR token for token with nothing set: the
             # tiny pair on the fa3 backend (auto -> FA3) and the MLA + MoE target on FlashMLA
             # pages (auto -> FlashMLA)
             step auto-doctor ${AUTO_DOCTOR_LIMIT:-100} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mha_fa3 --budgets ${AUTO_DOCTOR_BUDGETS:-8,16,32,64} --batch-sizes 1,8,32 \
               --out "$OUT/doctor_graphs_mha_fa3_h200.json"
             step auto-e2e ${AUTO_E2E_LIMIT:-280} python3 scripts/e2e_lossless.py \
               --cases "${AUTO_CASES:-tiny_fa3:16,32;mla_fmla_auto:16}" --batch-sizes 1,4 \
               --prompts 12 --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_prefix_auto_h200.json" ;;
    mlakt)   # where the MLA points that miss fa3 with the FlashMLA prefix spend their time
             # (session 35; batch 1 at 2k / 16k, batch 8 at 2k): each timed graph's kernels from
             # the PyTorch profiler (device time each, gaps, span) beside the event timing
             step mlakt ${MLAKT_LIMIT:-240} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-sglang-triton --mla-prefix --kernel-times --batch-sizes ${MLAKT_BS:-1,8} \
               --budgets ${MLAKT_BUDGETS:-8,16,32,64} --contexts ${MLAKT_CTX:-2048,16384} \
               --out "$OUT/tree_verify_mla_kernel_times_h200.json" ;;
    mergetile) # the merging launch's own tile (session 35: TreeAttention.merge_config_for;
             # where the full launch's 32-row / 64-row MLA tiles took 23-30 us for the tree
             # keys alone): the prefix paths of issue 4's grid at 2k / 16k with candidate
             # merge tiles (outputs checked against the default's)
             step merge-mla ${MERGE_MLA_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-sglang-triton --mla-prefix --contexts ${MERGE_CTX:-2048,16384} \
               --merge-sweep "${MERGE_MLA_SWEEP:-16,64,4,2;16,32,4,2;16,32,2,2;16,16,4,1;16,64,4,2,2;32,64,4,2}" \
               --out "$OUT/tree_verify_merge_tile_mla_h200.json"
             step merge-mha ${MERGE_MHA_LIMIT:-300} python3 scripts/bench_tree_verify.py --kinds mha \
               --no-sglang-triton --mha-prefix --contexts ${MERGE_CTX:-2048,16384} \
               --merge-sweep "${MERGE_MHA_SWEEP:-64,64,4,3;16,64,4,2;32,64,4,2;16,32,2,2;32,32,4,2}" \
               --out "$OUT/tree_verify_merge_tile_mha_h200.json" ;;
    mergecheck) # the merging launch's tile, served: the GPU tests of both prefix paths, the
             # doctor's mla_flashmla / mha_fa3 rows (graph == eager, against the fp32
             # reference) and DDTREE against AR on FlashMLA pages with nothing set
             step merge-gpu-tests ${MERGE_TESTS_LIMIT:-200} python3 -m pytest -q \
               tests/gpu/test_mla_prefix_gpu.py tests/gpu/test_mha_prefix_gpu.py
             step merge-doctor ${MERGE_DOCTOR_LIMIT:-150} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mla_flashmla,mha_fa3 --budgets 4,8,9,16,32,64,128 --batch-sizes 1,2,8,32 \
               --out "$OUT/doctor_graphs_merge_tile_h200.json"
             [ -z "${MERGE_E2E-1}" ] || step merge-e2e ${MERGE_E2E_LIMIT:-280} python3 scripts/e2e_lossless.py \
               --cases "${MERGE_CASES:-mla_fmla_auto:16,32}" --batch-sizes 1,4 --prompts 12 \
               --eager-check= --speed= --deterministic= \
               --out "$OUT/e2e_lossless_merge_tile_h200.json" ;;
    mlagrid) # issue 4's MLA grid (batch 1 / 8 / 32 x budget 8 / 16 / 32 / 64 x 2k / 16k / 64k
             # keys) with the FlashMLA-prefix path as served beside ours alone and fa3
             step mlagrid ${MLAGRID_LIMIT:-240} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-sglang-triton --mla-prefix --out "$OUT/tree_verify_fa3_fmla_mla_h200.json" ;;
    widemla) # e67d3b1: MLA budgets 31 / 32 at batch 1 / 2 on Hopper serve the 8-warp 64-row tile
             # with 128-key splits. Kernel A/B against the 32-row tile it replaced (same 128-key
             # splits) and the 8-warp tile with 256-key splits (session 33's), the served tile
             # timed again last (order check), planned for 1,600 keys (the cost-curve servers)
             # and for 262,144
             widemla_sweep="32,64,4,2,1,0,128;64,64,8,2,1,0,256;64,64,8,2,1,0,128"
             step widemla-tv-short ${WIDEMLA_TV_LIMIT:-150} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-baselines --batch-sizes 1,2 --budgets 31,32 --contexts 576,1024,1536 \
               --plan-context 1600 --sweep "$widemla_sweep" --kernel-times \
               --out "$OUT/tv_wide_mla_plan1600_h200.json"
             step widemla-tv-long ${WIDEMLA_TV_LIMIT:-150} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-baselines --batch-sizes 1,2 --budgets 31,32 --contexts 2048,8192,65536 \
               --plan-context 262144 --sweep "$widemla_sweep" \
               --out "$OUT/tv_wide_mla_plan262k_h200.json" ;;
    mlahopper) # session 44's Hopper MLA rule (_mla_hopper_config): the served tiles against the
             # 32-row tile with 256-key splits (what these points served before) in one call,
             # the doctor's graph rows and DDTREE against AR token for token where it changed
             step mlahopper-tv ${MLAHOPPER_TV_LIMIT:-150} python3 scripts/bench_tree_verify.py --kinds mla \
               --no-baselines --batch-sizes 2,4,8,16 --budgets 7,15,16,23,31,32 \
               --contexts 576,2048,65536 --plan-context 262144 --sweep "32,64,4,2" \
               --out "$OUT/tv_mla_hopper_rule_h200.json"
             step mlahopper-doctor ${MLAHOPPER_DOCTOR_LIMIT:-200} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mla,mla_fp8 --budgets 7,15,16,23,29,32 --batch-sizes 2,4,8 \
               --out "$OUT/doctor_mla_hopper_rule_h200.json"
             step mlahopper-e2e ${MLAHOPPER_E2E_LIMIT:-330} python3 scripts/e2e_lossless.py \
               --cases kimi_int4:7,15,16 --batch-sizes 4,8 --prompts 12 --eager-check= --speed= \
               --deterministic= --out "$OUT/e2e_lossless_kimi_int4_hopper_rule_h200.json" ;;
    widemlaserve) # the served tile token for token (8-layer int4 Kimi rank), the doctor's graph
             # rows at budgets 30-32, and the 61-layer rank's verify / decode at budgets 31 / 32
             step widemla-e2e ${WIDEMLA_E2E_LIMIT:-300} python3 scripts/e2e_lossless.py \
               --cases kimi_int4:31,32 --batch-sizes 1,2 --prompts 12 --eager-check= --speed= \
               --deterministic= --out "$OUT/e2e_lossless_kimi_int4_b31_b32_h200.json"
             step widemla-doctor ${WIDEMLA_DOCTOR_LIMIT:-200} python3 -m sglang_ddtree.cli doctor --graphs \
               --kernels mla,mla_fp8 --budgets 30,31,32 --batch-sizes 1,2,8 \
               --out "$OUT/doctor_mla_b30_b32_h200.json" ;;
    widemlacosts) # (session 45 ran it with WIDEMLA_COSTS_BUDGETS=7,15 WIDEMLA_COSTS_NAME=b7_b15_bm8;
             # WIDEMLA_COSTS_ARGS adds arguments.) WIDEMLA_COSTS_MOE="SPEC ..." serves every
             # server a variant of the fused-MoE table, written here for this card
             # (scripts/moe_table_variant.py's SPECs), e.g. "32:block_m=32,half_m=1": session
             # 68's 32-row blocks for the M 17-32 band. WIDEMLA_COSTS_MOE_DEVICE="NAME" bases
             # that table on another card's overrides (moe_table_variant.py --device), e.g.
             # "NVIDIA H100 80GB HBM3" serves an H200 the H100's table (its M 28-32 band on
             # 32-row blocks since session 70), with or without SPECs
             COSTS_TABLE_ASKED="${WIDEMLA_COSTS_MOE:-}${WIDEMLA_COSTS_MOE_DEVICE:-}"
             [ -z "$COSTS_TABLE_ASKED" ] || python3 scripts/moe_table_variant.py ${WIDEMLA_COSTS_MOE_DEVICE:+--device "$WIDEMLA_COSTS_MOE_DEVICE"} "$OUT/moe_configs_costs.json" ${WIDEMLA_COSTS_MOE:-} >> "$OUT/session.log" 2>&1 || { log "widemlacosts: WIDEMLA_COSTS_MOE / _DEVICE refused (above): not run"; continue; }
             kimi61_costs widemla-costs ${COSTS_LIMIT:-560} ${WIDEMLA_COSTS_BUDGETS:-31,32} \
               ${WIDEMLA_COSTS_NAME:-b31_b32} \
               ${COSTS_TABLE_ASKED:+--server-env SGLANG_DDTREE_MOE_CONFIG=$OUT/moe_configs_costs.json} \
               ${WIDEMLA_COSTS_ARGS:-} ;;
    routercosts) # budget 31's verify on the 61-layer int4 Kimi rank with the MoE router's GEMM
             # on our skinny kernel under PDL (session 65's profile: the 32-row router runs
             # cuBLAS with a split-K reduce where AR's one row takes SGLang's dsv3 kernel), or
             # the skinny kernel on every wide-K dense GEMM of 17-32 rows under PDL, against the
             # budget as served, in one lease (ROUTERCOSTS_BUDGETS: another budget). Variants
             # (ROUTERCOSTS_VARIANTS, in order; a name may repeat, each run to its own JSON,
             # ..._bBUDGETS_NAME_rK, AR's ..._ar_rK): ar (AR's decode alone), served (since session
             # 75 the router's GEMM on our kernel under PDL on sm_90: DDTREE's auto),
             # router_off (SGLANG_DDTREE_ROUTER_GEMM=0: SGLang's router GEMMs), router_pdl
             # (the switches given), skinny_pdl, each DDTREE one with no AR. ROUTERCOSTS_LIMIT
             # seconds each (default 130; about 85 s a run on a warm H100 in session 74), plus
             # ROUTERCOSTS_COLD (default 170) for ar and the call's first DDTREE run: on a fresh
             # machine the first AR and DDTREE servers compile their kernels (session 74: AR
             # started in 167 s, then the served run was cut at 330 s). Sessions 74-75 ran
             # "served router_pdl" (served then: SGLang's router GEMMs) and "skinny_pdl"
             # (8.23 ms at budget 31, slower); next: "ar served router_off served router_off"
             cold=${ROUTERCOSTS_COLD:-170} first_tree=1
             declare -A runs=()  # runs of each variant so far
             router_costs() {  # router_costs NAME [--baselines= --server-env K=V ...]; JSON stem
               # ar_rK for AR, bBUDGETS_NAME_rK (ROUTERCOSTS_BUDGETS, default 31; commas -> _)
               local name=$1 lim=${ROUTERCOSTS_LIMIT:-130} budgets=${ROUTERCOSTS_BUDGETS:-31}; shift
               local k=$(( ${runs[$name]:-0} + 1 )); runs[$name]=$k
               local stem=b${budgets//,/_}_${name}_r$k
               if [ "$name" = ar ]; then
                 lim=$((lim + cold)); budgets=""; stem=ar_r$k
               elif [ $first_tree = 1 ]; then
                 lim=$((lim + cold)); first_tree=0
               fi
               kimi61_costs routercosts-${name}_r$k $lim "$budgets" $stem "$@"
             }
             for v in ${ROUTERCOSTS_VARIANTS:-ar served router_off}; do
               case $v in
                 ar) router_costs ar ;;
                 served) router_costs served --baselines= ;;
                 router_off) router_costs router_off --baselines= \
                   --server-env SGLANG_DDTREE_ROUTER_GEMM=0 ;;
                 router_pdl) router_costs router_pdl --baselines= \
                   --server-env SGLANG_DDTREE_ROUTER_GEMM=1 --server-env SGLANG_DDTREE_SKINNY_PDL=1 ;;
                 skinny_pdl) router_costs skinny_pdl --baselines= \
                   --server-env SGLANG_DDTREE_SKINNY_GEMM=1 --server-env SGLANG_DDTREE_SKINNY_PDL=1 ;;
                 *) log "routercosts: unknown variant $v (ar, served, router_off, router_pdl, skinny_pdl): not run" ;;
               esac
             done ;;
    tvspec) # tree verify's unspecialized twin (session 31; timed in session 32, kept) against the kernel specialized at
             # N % 16 == 0 (before: budget 31 took 32.6 us a call in the Kimi profile, 32 took
             # 26.4): the old one rebuilt from this checkout with the twin's opt-out removed,
             # two alternating rounds each, budgets either side of N = 16 / 32 / 64; MLA at
             # batch 1 / 2 (the planner's few-rows tiles); TVSPEC_KINDS=mla,mha adds MHA, whose
             # N % 16 == 0 binary used fewer registers (190 against 255 at budget 31, 64 x 64)
             rm -rf /tmp/tv_spec && cp -r triton_kernels /tmp/tv_spec \
               && sed -i 's/triton.jit(do_not_specialize=("N", "stride_mb", "stride_mi"))(/triton.jit(/' \
                    /tmp/tv_spec/tree_attention.py \
               && ! grep -q do_not_specialize /tmp/tv_spec/tree_attention.py \
               && log "tvspec: /tmp/tv_spec = the specialized variant"
             # first the twin's correctness at the budgets it changes (N = 16 / 32 / 64: none of
             # the doctor's default budgets): graph == eager, against the fp32 reference
             step tvspec-doctor ${TVSPEC_DOCTOR_LIMIT:-180} python3 -m sglang_ddtree.cli doctor \
               --graphs --budgets 15,31,63 --out "$OUT/doctor_graphs_spec_h200.json"
             for r in 1 2; do
               for v in new old; do
                 kd=(); [ $v = old ] && kd=(--kernels-dir /tmp/tv_spec)
                 step tvspec-$v-$r ${TVSPEC_LIMIT:-120} python3 scripts/bench_tree_verify.py \
                   --kinds ${TVSPEC_KINDS:-mla} --no-baselines --batch-sizes ${TVSPEC_BS:-1,2} \
                   --budgets ${TVSPEC_BUDGETS:-15,16,31,32,63,64} --contexts ${TVSPEC_CONTEXTS:-512,2048,16384} \
                   --plan-context 262144 ${kd[@]+"${kd[@]}"} --out "$OUT/tree_verify_spec_${v}_r${r}_h200.json"
               done
             done
             step tvspec-ab 60 python3 scripts/bench_tree_verify.py \
               --ab "new=$OUT/tree_verify_spec_new_r1_h200.json,$OUT/tree_verify_spec_new_r2_h200.json" \
               --ab "old=$OUT/tree_verify_spec_old_r1_h200.json,$OUT/tree_verify_spec_old_r2_h200.json" \
               --out "$OUT/tree_verify_spec_ab_h200.json" ;;
    *) log "unknown step $s (quick unit cudaext treeclocks treebench moe moetune moeq jitbg jitwait moebench moee2e det syncs e2e e2e2gpu tp2 verify train benche2e costs profile memcheck memchecktree memcheckverify doctor commit bench fmla draftattn drafte2e draftfi draftab moegrid moegridmid moelive moelivetest moerun skinny skinnyrouter skinnyserve skinnycosts kimifmla moedual kimiprofile moeprologue moealign moeserve moehalf mlareduce fa3 tvwide tvwidecheck fmlabatch tvncu tvtail fa3prefix prefixauto mlakt mergetile mergecheck mlagrid tvspec)" ;;
  esac
done
(cd /tmp && tar czf "$OUT/logs.tgz" ddtree_e2e/*.log ddtree_e2e_b/*.log ddtree_e2e_det/*.log 2>/dev/null)
tail -40 "$OUT/session.log"
