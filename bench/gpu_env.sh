# Sourced by bench/gpu_*.sh: PYTHONPATH (src/ + carried wheels), GPU facts, a synthetic
# d12 token shard at $SHARD. Logs go under $OUT. On a GPU machine without network, bring
# the pure-Python config packages as wheels, made where pip works:
#   pip download --no-deps -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # an sdist on PyPI
# .whl/ is git-ignored: name it in the device tool's `carry` so it travels.
OUT=${OUT:-/tmp/gpu_mfu}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import hydra, omegaconf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"

SHARD=/tmp/d12_shard.bin
python3 - "$SHARD" <<'EOF'
import sys, numpy as np
# 64M random GPT-2 token ids, raw uint16 (no header); the last 1% is the validation tail
np.random.default_rng(0).integers(0, 50257, 64 * 2**20, dtype=np.uint16).tofile(sys.argv[1])
EOF

