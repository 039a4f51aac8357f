#!/bin/bash
# A CPU-only virtualenv in which real SGLang imports (server args, plugin loader, speculative
# registry, worker modules; no GPU kernels run). Used by .ci/run and by developers without a GPU.
# Usage: bash scripts/cpu_sglang_env.sh VENV_DIR 0.5.17
# SGLang imports torchvision at import time, so torch and torchvision must import together
# (torch 2.14.1 + torchvision 0.29.1 do); SGLang goes in with --no-deps (its torch pin is for
# GPUs) plus the light packages its import path needs.
set -euo pipefail
venv=$1; ver=$2
python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q torch==2.14.1 torchvision==0.29.1 numpy
case $ver in
  0.5.17) pins="transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 compressed-tensors==0.13.0 openai==2.6.1";;
  0.5.23) pins="transformers==5.19.0 tokenizers==0.23.2 xgrammar==0.2.7 compressed-tensors==0.18.0 openai==2.8.0";;
  *) echo "unknown SGLang version $ver (known: 0.5.17, 0.5.23)" >&2; exit 2;;
esac
"$pip" install -q --no-deps "sglang==$ver" $pins apache-tvm-ffi==0.1.11
"$pip" install -q orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
  tqdm ipython aiohttp dill sentencepiece gguf partial_json_parser einops setproctitle uvicorn \
  fastapi jsonschema opentelemetry-api interegular huggingface-hub==1.33.0 safetensors regex \
  pyyaml filelock jinja2 soundfile scipy xxhash sniffio anyio httpx zstandard distro jiter loguru \
  python-multipart watchfiles uvloop triton==3.6.0 pytest
"$venv/bin/python" -c "from sglang.srt.plugins import load_plugins; from sglang.srt.speculative.spec_info import SpeculativeAlgorithm; print('sglang', __import__('sglang').__version__, 'imports on CPU')"
