#!/usr/bin/env bash
# One-command GPU check of lightning_resctl (<= 16 minutes on one H100/H200-class GPU, in two device calls of 8).
#
#   bash benchmarks/gpu_check.sh             # run every step, write one markdown report (its path is printed)
#   bash benchmarks/gpu_check.sh --dry-run   # list the steps, run nothing
#   bash benchmarks/gpu_check.sh kernel-tests bench-recipe   # only the named steps (in the order below): a
#                                            # device call of 10 minutes runs the check in two parts
#
# Steps, in order (the script exits non-zero when any step fails):
#   1 kernel-tests    the rules' Triton kernels on the device (TRITON_INTERPRET=0: ResController, MGR with its
#                     inversion, AttnRes / Block AttnRes), fp32/bf16, forward and backward against the torch
#                     references, small odd shapes and rows ~1e20: pytest -k device_ tests/test_mgr_kernels.py (the
#                     normal suite runs the same tests on CPU under the Triton interpreter)
#   2 kernels-aot     the compiler's prediction for the shapes the benchmarks below measure, on this device's
#                     architecture: registers, spills, shared memory, theoretical occupancy, load width and
#                     (benchmarks/kernels_aot.py --no-bytes: the bytes moved are counted by the suite, on CPU)
#   3 bench-rescontroller  merge alone: eager / torch.compile / Triton times, bytes moved as % of the measured
#                     device copy bandwidth (goal >= 80 %, and no slower than compile)
#   4 bench-mgr       MGR's fused kernels (inverted, fp32 / bf16, n in {4, 8}, C in {768, 2048, 4096}): % of the
#                     copy bandwidth forward and forward + backward, beside torch.compile of the reference (goal
#                     >= 80 %, never slower)
# Steps 1-5 (issue 55's figures) are budgeted for one device call of 8 minutes:
#   bash benchmarks/gpu_check.sh kernel-tests kernels-aot bench-rescontroller bench-mgr bench-peers
#   5 bench-peers     GPT-2-small-sized training step (12 layers, C=768, 12 heads, batch 8 x 1024 tokens, bf16
#                     autocast): every rule and the peers vs plain, eager (goals: rescontroller <= 1.05x, mgr n=4
#                     competitive <= 1.20x, attnres-block <= 1.15x, hc and mhc-lite <= 1.30x, mhc <= 1.6x;
#                     benchmarks/floor.py prints the streams' byte floor beside them)
#   6 bench-compiled  the same step under a whole-model torch.compile (mode "default") for plain, rescontroller,
#                     mgr n=4 competitive, attnres-block, hc and mhc-lite: ratio to compiled plain (goals 1.02 /
#                     1.07 / 1.04 / 1.10 / 1.10), vs the eager step, compile time (first step), peak memory per rule
#   7 bench-cudagraphs  the same under mode "reduce-overhead" (CUDA graphs; inductor's cache warm from step 6): at
#                     least as fast as "default" for every rule, no re-recording
#   8 bench-recipe    the at-scale recipe (each block compiled on its own, checkpointed, bf16 autocast), GPT-2-small
#                     width at 12 and 24 layers (batch 4 x 1024 tokens): unique graphs, first step (compile), step time
#                     and peak memory of each chain rule vs plain (benchmarks/bench_recipe.py --layers)
# Steps 6-8 (issue 54's figures) are budgeted for one device call of 8 minutes:
#   bash benchmarks/gpu_check.sh bench-compiled bench-cudagraphs bench-recipe
# Each step's output goes into the report as soon as the step ends (a later step's failure or a killed call leaves
# the earlier steps' figures there).
# Without CUDA it says so and exits 0. REPORT=path overrides the report path.
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(kernel-tests kernels-aot bench-rescontroller bench-mgr bench-peers bench-compiled bench-cudagraphs bench-recipe)
GPT2_SMALL="--device cuda --dtype bf16 --layers 12 --C 768 --heads 12 --T 1024 --batch 8 --vocab 50304"
COMPILED_RULES="rescontroller,mgr n=4 competitive,attnres-block (lightning_resctl),hc (lightning_resctl),mhc-lite (lightning_resctl)"
declare -A CMD=(
  [kernel-tests]="env TRITON_INTERPRET=0 LIGHTNING_RESCTL_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_mgr_kernels.py -k device_"
  [kernels-aot]="python benchmarks/kernels_aot.py --arch device --C 768 2048 4096 8192 --dtypes fp32 bf16 --n 4 8 --no-bytes"
  [bench-rescontroller]="env TRITON_INTERPRET=0 python benchmarks/bench_rescontroller.py --device cuda --gpt-batch 8"
  [bench-mgr]="env TRITON_INTERPRET=0 python benchmarks/bench_mgr.py --kernels --streams 4 8 --dims 768 2048 4096 --dtypes fp32 bf16"
  [bench-peers]="env TRITON_INTERPRET=0 python benchmarks/bench_peers.py $GPT2_SMALL --reps 10 --warmup 2 --compile none"
  [bench-compiled]="env TRITON_INTERPRET=0 python benchmarks/bench_peers.py $GPT2_SMALL --reps 10 --warmup 2 --only '$COMPILED_RULES' --compile default"
  [bench-cudagraphs]="env TRITON_INTERPRET=0 python benchmarks/bench_peers.py $GPT2_SMALL --reps 10 --warmup 2 --only '$COMPILED_RULES' --compile reduce-overhead"
  [bench-recipe]="env TRITON_INTERPRET=0 python benchmarks/bench_recipe.py --device cuda --dtype bf16 --layers 12 24 --C 768 --heads 12 --T 1024 --batch 4 --vocab 50304 --reps 5 --warmup 1 --rules mgr-competitive,attnres-block,hc,mhc-lite"
)
declare -A LIMIT=([kernel-tests]=90 [kernels-aot]=60 [bench-rescontroller]=120 [bench-mgr]=90 [bench-peers]=120 [bench-compiled]=200 [bench-cudagraphs]=110 [bench-recipe]=170)

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
if [[ $# -gt 0 ]]; then
  for name in "$@"; do
    if [[ -z "${CMD[$name]+set}" ]]; then
      echo "gpu_check: unknown step '$name'; the steps are: ${STEPS[*]}" >&2
      exit 2
    fi
  done
  SELECTED=()
  for s in "${STEPS[@]}"; do
    for name in "$@"; do [[ "$name" == "$s" ]] && SELECTED+=("$s") && break; done
  done
  STEPS=("${SELECTED[@]}")
fi

if [[ $DRY_RUN -eq 1 ]]; then
  echo "gpu_check steps (dry run, nothing executed):"
  i=1
  for s in "${STEPS[@]}"; do
    echo "$i. $s (limit ${LIMIT[$s]} s): ${CMD[$s]}"
    i=$((i + 1))
  done
  exit 0
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check, exiting 0"
  exit 0
fi

REPORT="${REPORT:-${TMPDIR:-/tmp}/lightning_resctl_gpu_check_$(date +%Y%m%d_%H%M%S).md}"
{
  echo "# lightning_resctl GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- device: $(python -c 'import torch; print(torch.cuda.get_device_name())')"
  echo "- torch: $(python -c 'import torch; print(torch.__version__)'), triton: $(python -c 'import triton; print(triton.__version__)' 2>/dev/null || echo absent)"
} > "$REPORT"

failed=0
for s in "${STEPS[@]}"; do
  echo "== $s: ${CMD[$s]}"
  start=$(date +%s)
  out=$(timeout "${LIMIT[$s]}" bash -c "${CMD[$s]}" 2>&1)
  rc=$?
  secs=$(( $(date +%s) - start ))
  echo "$out" | tail -40
  status="ok"
  if [[ $rc -ne 0 ]]; then status="FAILED (exit $rc)"; failed=1; fi
  {
    echo
    echo "## $s — $status, ${secs} s"
    echo
    echo "\`${CMD[$s]}\`"
    echo
    echo '```'
    echo "$out" | tail -80
    echo '```'
  } >> "$REPORT"
done
echo "gpu_check report: $REPORT"
exit $failed
