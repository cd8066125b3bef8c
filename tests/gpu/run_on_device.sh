#!/usr/bin/env bash
# GPU checks on a machine that has CUDA but not this project's environment (see README "GPU checks").
# Expects, beside the checkout: .whl/ (wheels of the deps the machine lacks) and .gpu/small.gguf
# (tests/small_gguf.py: the default model cut to a few layers, to fit a 64 MiB transfer).
set -uo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STEADFAST_MODEL=$PWD/.gpu/small.gguf
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout "${GPU_TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu "$@" 2>&1 | tee "$out/gpu-tests.log"
