#!/usr/bin/env bash
# MFU of the d12 preset on one CUDA GPU, bf16 + torch.compile, against the plain GPT of the
# same shape (bench/bench_train.py), on synthetic token shards (throughput does not depend on
# the tokens' values). Run from the repository root on a GPU machine with torch installed;
# hydra-core/omegaconf are taken from the environment or from wheels in .whl/.
#
#   bash bench/gpu_mfu.sh [extra Hydra overrides...]
#
# Writes its logs under ${OUT:-/tmp/gpu_mfu}.
set -uo pipefail
source bench/gpu_env.sh

common=(--model d12 trainer=gpu data=shards "data.path=$SHARD" trainer.eval_tokens=131072 "$@")
echo "== d12, bf16 + compile, sweeper vs plain (3 alternating pairs, 10 timed steps each)"
timeout 420 python3 bench/bench_train.py --compile --repeats 3 --steps 10 "${common[@]}" 2>&1 \
  | tee "$OUT/d12_compile.log" | grep -v Warning
