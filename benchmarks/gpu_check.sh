#!/usr/bin/env bash
# The checks that need a GPU, on a 1-GPU machine (an H100): under 8 minutes once set up. Each part
# prints `PASS <name>` or `FAIL <name>`; the script exits 1 when any part failed.
#
#     bash benchmarks/gpu_check.sh [PART ...]      (default: every part, in this order)
#
# Parts:
#   setup-main        `make`'s .venv (the Makefile's stamp target, every make target's prerequisite).
#   setup-vllm        .venv-vllm-gpu: `make vllm-env` with vLLM's CUDA build (GPU_CHECK_VLLM, default
#                     vllm==0.32.0, the version the backend was checked against), which brings its own torch.
#   cuda-torch        .venv's torch sees the GPU (parts learner-tree and deepspeed need it).
#   vllm-cuda         tests/vllm on the GPU: capture (token ids + log-probs on the LLM span, against the
#                     transformers model on the same float32 weights), LoRA reload while requests run,
#                     full reload with the prefix-cache reset, `boltstream serve --backend vllm` on SmolLM2.
#   bench-serving     benchmarks/bench_serving.py, short. NOTE: neither benchmark has a backend flag, and the
#   bench-reload      benchmarks/bench_reload.py, short.  worker they start gets no BOLTSTREAM_* variable
#                     from this environment: both run the transformers backend on the CPU, as written.
#   learner-tree      one learner step on CUDA (SmolLM2, full weights), flat vs prefix tree: the same loss
#                     and gradient norm from the same weights, then both timed on agent-shaped samples.
#   deepspeed         DeepSpeed ZeRO-2 on one GPU (nccl, loopback): its step equals the plain torch step.
#
# Assumes: Linux x86-64, one NVIDIA GPU with a driver for the CUDA that PyPI's torch and vLLM wheels are
# built for, the CUDA toolkit (nvcc; DeepSpeed's install looks for it), python3 >= 3.11, make, GNU
# timeout, and pip reaching PyPI (or a mirror of it). `make`'s .venv pins torch==2.13.0: PyPI's Linux
# wheel of it is a CUDA build; where pip is set up for CPU-only wheels, point it at a CUDA index first
# (PIP_INDEX_URL), or cuda-torch fails and says so. The two setup parts are not in the 8 minutes (they
# download several GB the first time; later runs find them done in seconds).
#
# GPU_CHECK_DEVICE (cuda), GPU_CHECK_MODEL (smollm2) and GPU_CHECK_VLLM_VENV (.venv-vllm-gpu) let the
# parts be tried on a CPU (GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=tiny GPU_CHECK_VLLM_VENV=.venv-vllm, with
# the parts named); GPU_CHECK_SLACK multiplies every part's time limit (default 1).
set -uo pipefail
cd "$(dirname "$0")/.."

MAIN_VENV_TARGET=.venv/.boltstream-installed   # the Makefile's $(STAMP)
PY=.venv/bin/python
VLLM_GPU_VENV=${GPU_CHECK_VLLM_VENV:-.venv-vllm-gpu}
VLLM_PACKAGE=${GPU_CHECK_VLLM:-vllm==0.32.0}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MODEL=${GPU_CHECK_MODEL:-smollm2}
SLACK=${GPU_CHECK_SLACK:-1}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export GPU_CHECK_DEVICE=$DEVICE GPU_CHECK_MODEL=$MODEL GPU_CHECK_WORK=$WORK PYTHONUNBUFFERED=1

ALL_PARTS=(setup-main setup-vllm cuda-torch vllm-cuda bench-serving bench-reload learner-tree deepspeed)
if [ $# -gt 0 ]; then PARTS=("$@"); else PARTS=("${ALL_PARTS[@]}"); fi
FAILED=()
START=$SECONDS

# run NAME LIMIT_S CMD...: CMD under a time limit (SIGTERM, then SIGKILL 15 s later); PASS/FAIL line.
run() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    limit=$(awk -v l="$limit" -v s="$SLACK" 'BEGIN { printf "%d", l * s }')
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=15 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "PASS $name ($((SECONDS - t0))s)"
    else
        [ "$rc" -eq 124 ] && echo "$name: over its ${limit}s limit"
        echo "FAIL $name (exit $rc, $((SECONDS - t0))s)"
        FAILED+=("$name")
    fi
}

# The Python parts, written out so that `timeout` can run them.
cat >"$WORK/vllm_platform.py" <<'PY'
"""vLLM in this virtualenv runs on the device asked for (a CPU build would pass tests/vllm on the CPU)."""
import os

from vllm.platforms import current_platform

device = os.environ["GPU_CHECK_DEVICE"].split(":")[0]
assert current_platform.device_type == device, f"vLLM runs on {current_platform.device_type}, not {device}"
print(f"vLLM on {current_platform.device_type}")
PY

cat >"$WORK/learner_tree.py" <<'PY'
"""One step, flat then prefix tree, from the same weights; then both timed on agent-shaped samples."""
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_prefix_tree import agent_samples

from boltstream.learner.config import LearnerConfig, StepConfig
from boltstream.learner.model_setup import vocab_size
from boltstream.learner.tiny import shared_prefix_samples
from boltstream.learner.trainer import TorchTrainer

device, model, work = os.environ["GPU_CHECK_DEVICE"], os.environ["GPU_CHECK_MODEL"], os.environ["GPU_CHECK_WORK"]
cfg = LearnerConfig(model=model, device=device, lr=1e-5, lr_warmup_steps=0, workdir=f"{work}/tree",
                    step=StepConfig(max_tokens_per_micro_batch=40))  # several micro-batches


def trainer(tree: bool) -> TorchTrainer:
    return TorchTrainer(dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, prefix_tree=tree)))


def timed(t: TorchTrainer, samples: list) -> tuple:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = t.step(samples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return m, time.perf_counter() - t0


flat, tree = trainer(False), trainer(True)
assert tree.step_cfg.prefix_tree, "the model cannot run prefix trees here (see the log)"
assert next(flat.model.parameters()).device.type == device.split(":")[0]
samples = shared_prefix_samples(vocab_size(flat.model), seed=5)
(mf, _), (mt, _) = timed(flat, samples), timed(tree, samples)
assert mt.micro_batches > 1 and mt.unique_tokens < mt.input_tokens == mf.input_tokens, (mt, mf)
assert abs(mt.loss - mf.loss) <= 1e-4, (mt.loss, mf.loss)
assert abs(mt.grad_norm - mf.grad_norm) <= 1e-3 * mf.grad_norm, (mt.grad_norm, mf.grad_norm)
print(f"same step: loss {mf.loss:.6f} flat / {mt.loss:.6f} tree, grad norm {mf.grad_norm:.5f} / {mt.grad_norm:.5f}, "
      f"{mt.unique_tokens} of {mt.input_tokens} tokens computed by the tree")
agent = agent_samples(vocab_size(flat.model), 0, scale=4, groups=1)
longest = max(len(s["token_ids"]) for s in agent)
flat.step_cfg = dataclasses.replace(flat.step_cfg, max_tokens_per_micro_batch=-(-longest // 1024) * 1024 * 2)
tree.step_cfg = dataclasses.replace(tree.step_cfg, max_tokens_per_micro_batch=-(-longest // 256) * 256)
for _ in range(2):  # the first pays cuBLAS / allocator warm-up; the second is the one printed
    (mf, sf), (mt, st) = timed(flat, agent), timed(tree, agent)
print(f"agent-shaped step on {device}: {len(agent)} samples, {mf.input_tokens} tokens ({mt.unique_tokens} unique): "
      f"flat {sf * 1e3:.0f} ms in {mf.micro_batches} micro-batches, tree {st * 1e3:.0f} ms in {mt.micro_batches}: "
      f"{sf / st:.2f}x")
PY

cat >"$WORK/deepspeed_step.py" <<'PY'
"""DeepSpeed ZeRO-2, one rank on one device, against the plain torch learner on the same samples."""
import dataclasses
import os

import torch

from boltstream.learner.config import LearnerConfig, StepConfig
from boltstream.learner.deepspeed_backend import DeepSpeedTrainer
from boltstream.learner.model_setup import vocab_size
from boltstream.learner.tiny import shared_prefix_samples
from boltstream.learner.trainer import TorchTrainer

device, model, work = os.environ["GPU_CHECK_DEVICE"], os.environ["GPU_CHECK_MODEL"], os.environ["GPU_CHECK_WORK"]
# lr 1e-5: Adam's first update is ~lr * sign(g), so weights may differ by 2 lr where a gradient element is
# at rounding level; loss and gradient norm are compared tightly instead
cfg = LearnerConfig(model=model, device=device, lr=1e-5, lr_warmup_steps=0, workdir=f"{work}/ds", zero_stage=2,
                    step=StepConfig(max_tokens_per_micro_batch=40, prefix_tree=False))
plain = TorchTrainer(cfg)
samples = shared_prefix_samples(vocab_size(plain.model), seed=5)
mp = plain.step(samples)
ds = DeepSpeedTrainer(dataclasses.replace(cfg, deepspeed=True))
try:
    assert next(ds.model.parameters()).device.type == device.split(":")[0]
    md = ds.step(samples)
    assert md.micro_batches > 1 and abs(md.loss - mp.loss) <= 1e-5, (md.loss, mp.loss)
    assert abs(md.grad_norm - mp.grad_norm) <= 1e-4 * mp.grad_norm, (md.grad_norm, mp.grad_norm)
    for (name, p), q in zip(ds.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=3e-5, msg=name)
finally:
    ds.close()
print(f"ZeRO-2 on {device}: loss {md.loss:.6f} (plain {mp.loss:.6f}), grad norm {md.grad_norm:.5f} "
      f"(plain {mp.grad_norm:.5f}), {md.micro_batches} micro-batches, weights equal")
PY

for part in "${PARTS[@]}"; do
    case $part in
        setup-main) run setup-main 3600 make -s "$MAIN_VENV_TARGET" ;;
        setup-vllm) run setup-vllm 3600 make -s vllm-env VLLM_VENV="$VLLM_GPU_VENV" VLLM_PACKAGE="$VLLM_PACKAGE" VLLM_TORCH= ;;
        cuda-torch) run cuda-torch 60 "$PY" -c 'import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} in .venv sees no CUDA device (a CPU-only build?)"
print(torch.__version__, torch.cuda.get_device_name(0))' ;;
        vllm-cuda) run vllm-cuda 210 bash -c '"$0" "$1" && "$0" -m pytest -q -p no:cacheprovider tests/vllm' \
            "$VLLM_GPU_VENV/bin/python" "$WORK/vllm_platform.py" ;;
        bench-serving) run bench-serving 80 "$PY" benchmarks/bench_serving.py --model "$MODEL" --batches 1,8 \
            --prompt-tokens 64 --decode-steps 4 --engine-rounds 1 --rounds 1 --requests 4 --clients 2 --max-tokens 8 \
            --out "$WORK/serving.json" ;;
        bench-reload) run bench-reload 80 "$PY" benchmarks/bench_reload.py --model "$MODEL" --reloads 2 \
            --kinds full,lora --out "$WORK/reload.json" ;;
        learner-tree) run learner-tree 50 "$PY" "$WORK/learner_tree.py" ;;
        deepspeed) run deepspeed 50 "$PY" "$WORK/deepspeed_step.py" ;;
        *) echo "unknown part $part (parts: ${ALL_PARTS[*]})"; FAILED+=("$part") ;;
    esac
done

echo "=== ${#PARTS[@]} parts in $((SECONDS - START))s; failed: ${FAILED[*]:-none}"
[ "${#FAILED[@]}" -eq 0 ]
