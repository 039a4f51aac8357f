#!/usr/bin/env bash
# Apply sglang-ddtree's versioned deployment fixes to the installed triton / SGLang files.
#
#   scripts/apply_patches.sh [list|check|apply|revert|status] [--site-packages DIR] [--only ID]
#
# Same code as `sglang-ddtree patch ...`: sglang_ddtree/patcher.py, run as a file (stdlib only) so
# this works from a checkout without installing the package, and without putting the checkout's
# directories on sys.path. Default action: apply. The patches target the interpreter in $PYTHON
# (default: python3 on PATH): use the one that runs SGLang.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$#" -eq 0 ]; then
    set -- apply
fi
exec "${PYTHON:-python3}" -c 'import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")' "$repo/sglang_ddtree/patcher.py" "$@"
