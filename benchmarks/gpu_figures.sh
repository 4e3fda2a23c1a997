#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in stages that each fit one device command.
#
#   bash benchmarks/gpu_figures.sh STAGE...  (env pallas moepallas moepallasscan cmdbuf cbregions dlrm gpt124 kernelcheck kernels kernels1p3b normkernel losskernel ab124 abmoe gpt124scan nanogpt nanogptxla nanogptnocmdbuf gpt1p3b
#   gpt1p3bstart gpt1p3bunrolled gpt1p3bnoremat llama1b llama1bchunks fp8 fp8unrolled fp8scanned fp8curve
#   fp8kernelcheck fp8kernel fp8cache moe moebatch16 moevariants grouped profiles profilemoe sweep124 sweep1p3b sweepllama)
#   DEADLINE_S=540 bash benchmarks/gpu_figures.sh ...  (every run's limit cut to what is left
#   of 540 s; a run with under 30 s left is skipped, so one device command ends in time)
#
# Meant for a lent GPU machine with JAX (CUDA) and torch installed: plait runs from
# src/ (PYTHONPATH), missing pure-Python dependencies may be wheels under .whl/, and
# the reference checkouts (facebookresearch/dlrm, karpathy/nanoGPT) are expected under
# .refs/ (not part of plait; ignored by git). Each stage has its own time limit so a
# failure does not cost the stages after it; logs and JSON go to $OUT (default gpu-out/).
#
# A lent GPU comes with about 15 minutes and 10 minutes a command, less than all stages'
# limits together (about 85 minutes), so take them in the order of what they close
# (every stage's log ends with the GPU's SM clock and power while it ran):
#   1. fp8kernelcheck fp8unrolled (one command, DEADLINE_S=560, ~7 minutes): issue 29's
#      FP8 on gpt2-1.3b, bf16 and FP8 300 steps each, each run now in a process of its
#      own and without JAX's persistent cache, as `plait train` runs by default. On an
#      H200 on 2026-11-27 the FP8 step on the Triton pass measured 363 ms trained after
#      the bf16 run in one process with the cache on (0.857x), and 240.5 ms in a
#      `plait train` of its own without it (1.296x the bf16 run's 311.6 ms, not side by
#      side): this settles which. The kernel's modes first (~40 s: the GELU and q/k/v
#      parts' passes never timed alone; the GELU's gradient now in 64 x 64 blocks,
#      0.280 -> 0.230 ms alone; both GELU passes also with the GPU's approximate tanh,
#      whether the tanh is why they take twice the plain pass's time: 32 of the step's
#      48 ms of quantising). The curve was within 0.79% from step 100.
#   2. env nanogpt kernels1p3b sweep124 (one command, DEADLINE_S=560; .refs/nanoGPT):
#      issue 29's 1.1x nanoGPT side by side with the Triton kernels as now shipped ("auto"
#      takes them on a Hopper GPU; their first GPU run, an H200 on 2026-11-27, gave
#      1.073x, and 1.036x on XLA's fusions: `nanogptxla`), the loss-and-gradient kernel
#      since in its faster launch setting (one program a row: 3.56 ms alone against the
#      4.84 ms the 1.073x ran with), never timed in the step, and nanoGPT's bench.py also
#      with GPT-2's biases (--bias=True: plait as shipped against the same model,
#      `ratio_biases`; ~180 s); gpt2-1.3b on XLA's fusions and on both kernels (issue
#      29's 50% MFU: 47.8% on the H200 with both, 45.0% of record on an H100; ~140 s);
#      then whatever is left for the sweep's prediction against the measured steps on
#      gpt2-124m (issue 29's sweep item, never run on a GPU; `--run` now trains each
#      shape in a process of its own, the sweep's process holding no GPU memory up
#      front: the first GPU run of that too). fp8cache (~4 minutes) if
#      step 1 measured FP8 fast: the same two runs with the persistent cache on, bf16
#      filling XLA's per-fusion autotuning cache that the FP8 compile then reads (is
#      that what slowed it?).
#   3. ab124 cbregions (one command, DEADLINE_S=560, ~8 minutes; .refs/plait-before = git
#      archive 2a6f513 src benchmarks, with its COMMIT file): the step's tiny kernels cut by
#      a third (the gradient norm over stacks of like leaves, LayerNorm's parameters in
#      float32, the q/k/v biases' one reduction; compiled for an H100, gpt2-124m 988 -> 641
#      kernels, 61.50 -> 60.81 ms estimated), side by side with the tree before them; then
#      the rest of them overlapped in CUDA graphs' concurrent regions against XLA's
#      default scheduling (a flag; if it wins, plait's GPU defaults take it). fp8kernel
#      (~5 minutes): gpt2-1.3b's FP8 step on the kernel against XLA's pattern.
#   4. sweep1p3b, losskernel (the loss kernel's share of gpt2-124m's step, two rounds),
#      `kernels` (each kernel's share, ~2 minutes) and kernelcheck (the kernels alone in
#      their launch settings, ~1 minute: the norm kernel's best setting changed between
#      two runs on the H200).
#   5. MoE (issue 28, resolved on an H200's figure): env moe (~6 minutes, DEADLINE_S=420:
#      mixtral-mini as shipped beside its dense twin, two rounds; 0.743 on an H200 on
#      2026-11-26, the census puts an H100 at 0.69-0.72), pallas moepallas (~12 minutes,
#      two commands: the kernels' tilings, then mixtral-mini on the best), abmoe (~6
#      minutes, DEADLINE_S=420; .refs/plait-before = git archive 28e1e8a src benchmarks:
#      SwiGLU keeping the fused product's output; census -2.5%), moebatch16.
#   6. profiles (four traced steps, each program run's span: the loop's steps measured
#      3.5-4% longer than the traced ones on 2026-11-26, and command buffers are not why
#      -- `cmdbuf` found the loop slower without them, 1.6% on gpt2-124m, 5.7% on
#      gpt2-1.3b), fp8curve, moevariants, gpt1p3bunrolled, gpt1p3bstart, grouped;
#      moepallasscan last (its question is compile time only: compiled for an H100 here,
#      the scanned step's estimate is 39% longer than the unrolled one's, and XLA's own
#      compile of the unrolled step takes 32 s on a 2-core CPU against 68 s for the
#      tiles', so the GPU's 145-170 s go to work only a GPU does: autotuning, or the 96
#      Mosaic calls of 6 distinct kernels compiled when the program loads).
#   A fresh machine's first compiles are slow (mixtral-mini's step took over 95 s on
#   2026-11-26, 69.5 s the next time): leave a first run 150 s.
#   ab124 (with .refs/plait-before holding an earlier commit's src and benchmarks) measures
#   a change side by side; llama1b (issue 26, 56% MFU on an H100 on 2026-11-26) and
#   llama1bchunks re-measure what docs/benchmarks.md already holds.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
# mixtral-mini needed more than JAX's default 75% of an 80 GB GPU on 2026-11-26: the moe
# stages take 92% (unless set), so they give a speed either way; each log's peak device
# memory says whether it fits the default (59.4 GiB of an H100)
MOE_MEM="env XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# JAX's persistent cache (set above, to spare the stages' repeated compiles) is off in
# `plait train` unless a user sets it; the FP8 stages run without it (fp8cache with it)
NO_CACHE="env -u JAX_COMPILATION_CACHE_DIR"
# The GPU's clock, power and temperature every half second ($OUT/gpu-clocks.csv: epoch s,
# SM MHz, W, C), summed up per stage: a step measured slower than its kernels (the
# 2026-11-26 H100 profiles: gpt2-1.3b's two traced steps 317.7 ms a step, the loop's 329)
# may be a clock the power limit lowered
if command -v nvidia-smi >/dev/null 2>&1; then
  (while :; do
     echo "$(date +%s.%N),$(nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu \
       --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' ')"
     sleep 0.5
   done > "$OUT/gpu-clocks.csv") &
  CLOCKS_PID=$!
  trap 'kill $CLOCKS_PID 2>/dev/null' EXIT
fi
clocks() {  # clocks T0 T1: the SM clock and power between two epoch times
  [ -f "$OUT/gpu-clocks.csv" ] || return
  awk -F, -v a="$1" -v b="$2" '$1 >= a && $1 <= b && $2 != "" {n++; s += $2; p += $3;
    if (min == "" || $2 < min) min = $2; if ($2 > max) max = $2}
    END {if (n) printf "   GPU: SM clock mean %.0f MHz (%d-%d), power mean %.0f W, %d samples\n",
      s / n, min, max, p / n, n}' "$OUT/gpu-clocks.csv"
}
run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS e0
  e0=$(date +%s.%N)
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$((DEADLINE_S - SECONDS))
    if [ "$left" -lt 30 ]; then echo "== $name: skipped, ${left} s left of DEADLINE_S"; return; fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
  fi
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  clocks "$e0" "$(date +%s.%N)"
}
flag_ab() {  # flag_ab STEM BASE ALT XLA_FLAG: XLA's default (BASE) and XLA_FLAG (ALT) on the
  # steps as shipped: gpt2-124m two rounds alternating, default first; then gpt2-1.3b once
  # each, the flag first. Logs and JSON gpt124-STEM-{BASE,ALT}-{1,2}, gpt1p3b-STEM-*.
  local stem=$1 base=$2 alt=$3 flag=$4 round
  for round in 1 2; do
    run "gpt124-$stem-$base-$round" 90 python3 benchmarks/throughput.py \
      experiments/gpt2-124m.toml --steps 30 --json "$OUT/gpt124-$stem-$base-$round.json"
    XLA_FLAGS="${XLA_FLAGS:-} $flag" run "gpt124-$stem-$alt-$round" 90 python3 \
      benchmarks/throughput.py experiments/gpt2-124m.toml --steps 30 \
      --json "$OUT/gpt124-$stem-$alt-$round.json"
  done
  XLA_FLAGS="${XLA_FLAGS:-} $flag" run "gpt1p3b-$stem-$alt" 200 python3 \
    benchmarks/throughput.py experiments/gpt2-1.3b.toml --steps 16 --warmup 4 \
    --json "$OUT/gpt1p3b-$stem-$alt.json"
  run "gpt1p3b-$stem-$base" 200 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
    --steps 16 --warmup 4 --json "$OUT/gpt1p3b-$stem-$base.json"
}
for stage in "$@"; do
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
      python3 -c "import jax, flax, optax, orbax.checkpoint, torch; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'torch', torch.__version__)"
      # the copy's .git may be older than its files: name the files' own tree, which
      # `git log --format='%h %T'` here matches to the commit that has it
      echo "plait source tree $(cp .git/index /tmp/plait-index 2>/dev/null; GIT_INDEX_FILE=/tmp/plait-index \
        git add -A 2>/dev/null && GIT_INDEX_FILE=/tmp/plait-index git write-tree 2>/dev/null)" ;;
    dlrm)
      run dlrm-sync 240 python3 benchmarks/dlrm_vs_reference.py --reference .refs/dlrm --gpu \
        --torch-python python3 --rounds 3 --steps 50 --warmup 5 --log-every 1 --json "$OUT/dlrm-sync.json"
      run dlrm-log10 150 python3 benchmarks/dlrm_vs_reference.py --rounds 3 --steps 100 \
        --warmup 10 --log-every 10 --json "$OUT/dlrm-log10.json" ;;
    gpt124)
      run gpt124-auto 150 python3 benchmarks/throughput.py experiments/gpt2-124m.toml \
        --steps 30 --json "$OUT/gpt124-auto.json"
      run gpt124-chunks4 150 python3 benchmarks/throughput.py experiments/gpt2-124m.toml \
        --steps 30 --set model.loss_chunks=4 --json "$OUT/gpt124-chunks4.json" ;;
    ab124)  # gpt2-124m as shipped, this tree against an earlier plait's, alternating two
      # rounds on the same GPU (a change's own effect, not the session's noise). The
      # earlier tree's src/ and benchmarks/ under .refs/plait-before (ignored by git;
      # carried): git archive COMMIT src benchmarks | tar -x -C .refs/plait-before
      [ -d .refs/plait-before/src ] || { echo "== ab124: no .refs/plait-before/src"; continue; }
      echo "== ab124: before = commit $(cat .refs/plait-before/COMMIT 2>/dev/null || echo '(not recorded)')"
      for round in 1 2; do
        run "gpt124-now-$round" 150 python3 benchmarks/throughput.py \
          experiments/gpt2-124m.toml --steps 30 --json "$OUT/gpt124-now-$round.json"
        run "gpt124-before-$round" 150 env PYTHONPATH="$PWD/.refs/plait-before/src:/tmp/site" \
          python3 .refs/plait-before/benchmarks/throughput.py experiments/gpt2-124m.toml \
          --steps 30 --json "$OUT/gpt124-before-$round.json"
      done ;;
    abmoe)  # mixtral-mini and its dense twin, this tree against an earlier plait's
      # (.refs/plait-before, as for ab124), one round each: a change to the SwiGLU MLP or
      # the experts' dispatch measured on both models (a fresh machine's first compile of
      # mixtral-mini took over 95 s on 2026-11-26)
      [ -d .refs/plait-before/src ] || { echo "== abmoe: no .refs/plait-before/src"; continue; }
      # (both on the tiles: "auto" takes the Pallas kernels on a Hopper GPU since d81315a).
      # Since 84cfc8c this tree's script trains each model in a process of its own; a
      # before-tree older than that alternates them in one: compare like with like
      run moe-now 240 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --set 'model.moe.grouped="tiles"' --rounds 1 --steps 12 \
        --warmup 4 --json "$OUT/moe-now.json"
      run moe-before 240 $MOE_MEM env PYTHONPATH="$PWD/.refs/plait-before/src:/tmp/site" \
        python3 .refs/plait-before/benchmarks/moe_vs_dense.py experiments/mixtral-mini.toml \
        --rounds 1 --steps 12 --warmup 4 --json "$OUT/moe-before.json" ;;
    cbregions)  # XLA's command buffers recorded with concurrent regions of small kernels
      # (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS: independent small,
      # latency-bound kernels overlap; larger ones stay serialised) against the default
      # (LHS), alternating. The step's tiny kernels -- AdamW's updates of the small
      # parameters, the biases' reductions, casts: 161 on gpt2-124m, 776 on gpt2-1.3b
      # compiled for an H100 -- are mostly independent of each other. Compiled for an H100
      # the regions plan 14.12 GiB for gpt2-124m (14.30 by default) and 58.24 for gpt2-1.3b
      # (58.13): memory is not the risk.
      flag_ab cb lhs regions --xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS ;;
    cmdbuf)  # XLA's command buffers (CUDA graphs) on and off, alternating, on the unrolled
      # steps as shipped. On an H100 on 2026-11-26 the loop's steps took 3.5-4% longer than
      # the traced steps' span (gpt2-124m 66.9 against 64.2 ms, gpt2-1.3b 328.9 against
      # 317.7) with the GPU idle under 1.3% inside the trace, and while a profiler is
      # active XLA runs command buffers' kernels one by one (a CUPTI workaround in its
      # CommandBufferThunk): the difference might have been the graphs' own cost. It was
      # not: off, the loop ran 1.6% slower on gpt2-124m and 5.7% on gpt2-1.3b (an H100,
      # 2026-11-26), as a scanned gpt2-1.3b had run 23% slower on an H200.
      flag_ab cmdbuf on off --xla_gpu_enable_command_buffer= ;;
    losskernel)  # model.loss_kernel = "pallas" (the loss's log-sum-exp and label logit in
      # one Triton kernel; XLA's reduction read gpt2-124m's logits at 1.24 TB/s on an H100
      # on 2026-11-26, 2.67 ms a step): the kernel alone in its launch settings against
      # XLA's, then gpt2-124m's step with and without it, alternating two rounds
      run loss-kernel 150 python3 benchmarks/loss_kernel.py --json "$OUT/loss-kernel.json"
      for round in 1 2; do
        run "gpt124-lossxla-$round" 150 python3 benchmarks/throughput.py \
          experiments/gpt2-124m.toml --steps 30 --set 'model.loss_kernel="xla"' \
          --json "$OUT/gpt124-lossxla-$round.json"
        run "gpt124-losskernel-$round" 150 python3 benchmarks/throughput.py \
          experiments/gpt2-124m.toml --steps 30 --set 'model.loss_kernel="pallas"' \
          --json "$OUT/gpt124-losskernel-$round.json"
      done ;;
    kernels)  # model.norm_kernel and model.loss_kernel = "pallas" (Triton kernels for the
      # LayerNorms with the attention's residual add, and for the loss's reductions; never
      # run on a GPU): gpt2-124m's step on XLA's fusions, on each kernel and on both,
      # alternating two rounds (compiled for an H100: 65.43, 63.08, 63.85, 61.50 ms
      # since the loss kernel writes the gradient too)
      for round in 1 2; do
        for variant in xla norm loss both; do
          case $variant in
            xla) sets=(--set 'model.norm_kernel="xla"' --set 'model.loss_kernel="xla"') ;;
            norm) sets=(--set 'model.norm_kernel="pallas"' --set 'model.loss_kernel="xla"') ;;
            loss) sets=(--set 'model.norm_kernel="xla"' --set 'model.loss_kernel="pallas"') ;;
            both) sets=(--set 'model.norm_kernel="pallas"' --set 'model.loss_kernel="pallas"') ;;
          esac
          run "gpt124-kernels-$variant-$round" 120 python3 benchmarks/throughput.py \
            experiments/gpt2-124m.toml --steps 30 ${sets[@]+"${sets[@]}"} \
            --json "$OUT/gpt124-kernels-$variant-$round.json"
        done
      done ;;
    normkernel)  # the norm kernels alone in their launch settings against XLA's form, at
      # gpt2-124m's and gpt2-1.3b's streams (values compared, the best setting printed)
      run norm-kernel-124m 150 python3 benchmarks/norm_kernel.py --json "$OUT/norm-kernel-124m.json"
      run norm-kernel-1p3b 150 python3 benchmarks/norm_kernel.py --rows 16384 --width 1280 \
        --json "$OUT/norm-kernel-1p3b.json" ;;
    kernels1p3b)  # the same on gpt2-1.3b as shipped: XLA's fusions, then both kernels
      run gpt1p3b-kernels-xla 240 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
        --steps 16 --warmup 4 --set 'model.norm_kernel="xla"' --set 'model.loss_kernel="xla"' \
        --json "$OUT/gpt1p3b-kernels-xla.json"
      run gpt1p3b-kernels-both 240 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
        --steps 16 --warmup 4 --set 'model.norm_kernel="pallas"' \
        --set 'model.loss_kernel="pallas"' --json "$OUT/gpt1p3b-kernels-both.json" ;;
    gpt124scan)
      run gpt124-scan 150 python3 benchmarks/throughput.py experiments/gpt2-124m.toml \
        --steps 30 --set model.scan_layers=true --json "$OUT/gpt124-scan.json" ;;
    nanogpt)
      run nanogpt 420 python3 benchmarks/gpt_vs_nanogpt.py --reference .refs/nanoGPT \
        --torch-python python3 --rounds 2 --steps 30 --json "$OUT/nanogpt.json" ;;
    nanogptxla)  # the same with XLA's fusions for the norms and the loss (the default
      # before 2026-11-27: 1.036x on an H200 that day, 1.073x with the kernels)
      run nanogpt-xla 420 python3 benchmarks/gpt_vs_nanogpt.py --reference .refs/nanoGPT \
        --torch-python python3 --rounds 2 --steps 30 --set 'model.norm_kernel="xla"' \
        --set 'model.loss_kernel="xla"' --json "$OUT/nanogpt-xla.json" ;;
    fp8kernelcheck)  # FP8's quantisation pass (parallel.fp8_cast) alone against XLA's
      # fusion of the same at gpt2-1.3b's shapes, each mode in its launch settings: its
      # FP8 values against XLA's and its speed (first run: an H200, 2026-11-27, ~30 s:
      # 1.2-2.3x XLA's, values equal but 405 of 84M one step apart in the GELU's gradient)
      run fp8-kernelcheck 150 python3 benchmarks/fp8_kernel.py --repeat 10 \
        --json "$OUT/fp8-kernelcheck.json" ;;
    fp8kernel)  # gpt2-1.3b's FP8 step on the kernel ("auto" on a Hopper GPU) against
      # XLA's quantize-dequantize pattern (model.fp8_kernel = "xla"), one run each
      # (compiled for an H100: 258.6 against 304.0 ms estimated)
      for kernel in auto xla; do
        run "fp8-1p3b-kernel-$kernel" 240 python3 benchmarks/throughput.py \
          experiments/gpt2-1.3b.toml --steps 16 --warmup 4 --set "precision.matmul='fp8'" \
          --set "model.fp8_kernel='$kernel'" --json "$OUT/fp8-1p3b-kernel-$kernel.json"
      done ;;
    kernelcheck)  # the Triton kernels alone against XLA's form at gpt2-124m's sizes in
      # their launch settings (agree? faster? which setting? first run: an H200, 2026-11-27)
      # (names of their own: the losskernel and normkernel stages write loss-kernel.* and
      # norm-kernel-124m.*, and on 2026-11-27 one run's files overwrote the other's)
      run kernelcheck-loss 120 python3 benchmarks/loss_kernel.py --repeat 10 \
        --json "$OUT/kernelcheck-loss.json"
      run kernelcheck-norm-124m 100 python3 benchmarks/norm_kernel.py --repeat 10 \
        --json "$OUT/kernelcheck-norm-124m.json" ;;
    nanogptnocmdbuf)  # the same with XLA's command buffers off for plait (nanoGPT is
      # torch: the flag does not touch it), for when `cmdbuf` finds them a cost
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
        run nanogpt-cmdbuf-off 420 python3 benchmarks/gpt_vs_nanogpt.py \
        --reference .refs/nanoGPT --torch-python python3 --rounds 2 --steps 30 \
        --json "$OUT/nanogpt-cmdbuf-off.json" ;;
    gpt1p3b)  # as shipped since 2026-11-26: 64 layers unrolled, no remat, loss in 4
      # pieces (47.0% MFU on an H100 that day, before the q/k/v parts)
      run gpt1p3b 330 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
        --steps 16 --warmup 4 --json "$OUT/gpt1p3b.json" ;;
    gpt1p3bstart)  # its start-up: the init compiled for 4 minutes before its barriers
      run gpt1p3b-start 200 python3 benchmarks/startup.py experiments/gpt2-1.3b.toml \
        --layers 64 --rounds 1 --json "$OUT/gpt1p3b-start.json" ;;
    gpt1p3bunrolled)  # other layouts against the shipped one: unrolled with
      # save_attention (40.9% MFU, 33.4 GiB on an H100 on 2026-11-26: for smaller GPUs),
      # and scanned with full remat (the experiment's default before 2026-11-26)
      run gpt1p3b-unrolled-saveattn 330 python3 benchmarks/throughput.py \
        experiments/gpt2-1.3b.toml --steps 16 --warmup 4 --set "model.remat='save_attention'" \
        --json "$OUT/gpt1p3b-unrolled-saveattn.json"
      run gpt1p3b-scanned-full 330 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
        --steps 16 --warmup 4 --set "model.remat='full'" --set model.loss_chunks=1 \
        --set model.scan_layers=true --json "$OUT/gpt1p3b-scanned-full.json" ;;
    gpt1p3bnoremat)  # as shipped but scanned (41.4% MFU on an H200 on 2026-11-26; it
      # plans 60.4 GiB for an H100, over JAX's default 59.4)
      run gpt1p3b-noremat 330 python3 benchmarks/throughput.py experiments/gpt2-1.3b.toml \
        --steps 16 --warmup 4 --set model.scan_layers=true --json "$OUT/gpt1p3b-noremat.json" ;;
    llama1b)  # issue 26's MFU (16 x 2048, the loss in 8 pieces so that no remat fits; the
      # experiment ships loss_chunks = 8 since 2026-11-26),
      # then the pieces' own effect at a batch that fits either way
      run llama1b-chunks8 240 python3 benchmarks/throughput.py experiments/llama3.2-1b.toml \
        --steps 16 --warmup 4 --set model.loss_chunks=8 --json "$OUT/llama1b-chunks8.json" ;;
    llama1bchunks)
      run llama1b-b8-chunks1 200 python3 benchmarks/throughput.py experiments/llama3.2-1b.toml \
        --steps 16 --warmup 4 --set train.global_batch=8 --set model.loss_chunks=1 \
        --json "$OUT/llama1b-b8-chunks1.json"
      run llama1b-b8-chunks8 200 python3 benchmarks/throughput.py experiments/llama3.2-1b.toml \
        --steps 16 --warmup 4 --set train.global_batch=8 --set model.loss_chunks=8 \
        --json "$OUT/llama1b-b8-chunks8.json" ;;
    fp8cache)  # FP8 against bf16 on gpt2-1.3b, 30 steps each in processes of their own,
      # with JAX's persistent cache on in a fresh directory: the bf16 compile fills XLA's
      # per-fusion autotuning cache (JAX points XLA at it with the cache) and FP8's reads
      # it. Beside fp8unrolled's runs without the cache: whether the cache is what made
      # the FP8 step 363 ms on 2026-11-27, against 240.5 in a `plait train` without it
      run fp8-1p3b-cache 360 env JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache-fp8 python3 \
        benchmarks/fp8_vs_bf16.py experiments/gpt2-1.3b.toml --steps 30 --warmup 5 \
        --from-step 30 --window 1 --json "$OUT/fp8-1p3b-cache.json" ;;
    fp8|fp8unrolled|fp8scanned|fp8curve)  # throughput of both precisions on
      # gpt2-1.3b as shipped (unrolled, no remat: on an H200 on 2026-11-27, 0.943x on XLA's
      # pattern and 0.857x on the FP8 kernel "auto" takes on a Hopper GPU, both run after
      # bf16 in one process; 240.5 ms, 1.296x, in a process of its own: the header's 1.)
      # and scanned with full remat (its default before
      # 2026-11-26); then the 300-step curves on 124M (0.894x measured on an H100 on
      # 2026-11-26, the curves within 0.14%). fp8 runs all three; the others one each
      if [ "$stage" = fp8 ] || [ "$stage" = fp8unrolled ]; then  # 300 steps: the issue's
        # speed-up and its curve (within 1% from step 100) in one run, ~6 minutes
        run fp8-1p3b-unrolled 480 $NO_CACHE python3 benchmarks/fp8_vs_bf16.py \
          experiments/gpt2-1.3b.toml --steps 300 --json "$OUT/fp8-1p3b-unrolled.json"
      fi
      if [ "$stage" = fp8 ] || [ "$stage" = fp8scanned ]; then
        run fp8-1p3b-scanned 420 $NO_CACHE python3 benchmarks/fp8_vs_bf16.py \
          experiments/gpt2-1.3b.toml \
          --set "model.remat='full'" --set model.loss_chunks=1 --set model.scan_layers=true \
          --steps 20 --warmup 5 --from-step 20 --window 1 --json "$OUT/fp8-1p3b-scanned.json"
      fi
      if [ "$stage" = fp8 ] || [ "$stage" = fp8curve ]; then
        run fp8-124m-curve 540 $NO_CACHE python3 benchmarks/fp8_vs_bf16.py \
          experiments/gpt2-124m.toml \
          --steps 300 --json "$OUT/fp8-124m-curve.json"
      fi ;;
    pallas)  # model.moe.grouped = "pallas" (JAX's Pallas grouped GEMM kernels for Hopper,
      # what "auto" takes there): their tilings timed at mixtral-mini's shapes, then each
      # checked against jax.lax.ragged_dot's products and the expert MLP's gradients on
      # the best (pallas_blocks.py; on 2026-11-26 it printed nothing in 150 s)
      run pallas-blocks 240 python3 benchmarks/pallas_blocks.py --json "$OUT/pallas-blocks.json" ;;
    moepallas)  # mixtral-mini as shipped (on a Hopper GPU: the Pallas kernels; on the best
      # tiling of a pallas stage run before it on this machine) beside the tiles and the
      # dense twin, two rounds alternating (0.743 and 0.665 on an H200 on 2026-11-26; its
      # first compile took 170 s there)
      blocks=()
      [ -s "$OUT/pallas-blocks.json" ] && blocks=(--pallas-blocks "$OUT/pallas-blocks.json")
      run moe-pallas 480 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --rounds 2 --steps 12 --warmup 4 \
        --variant 'tiles:model.moe.grouped="tiles"' "${blocks[@]}" \
        --json "$OUT/moe-pallas.json" ;;
    moepallasscan)  # mixtral-mini on the Pallas kernels with its layers scanned (one
      # body: each kernel compiled once, where the unrolled step compiled 16 of each in
      # 145-170 s on an H200 on 2026-11-26) beside the unrolled one and the twin, one round
      blocks=()
      [ -s "$OUT/pallas-blocks.json" ] && blocks=(--pallas-blocks "$OUT/pallas-blocks.json")
      run moe-pallas-scan 420 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --rounds 1 --steps 12 --warmup 4 \
        --variant 'scanned:model.scan_layers=true' "${blocks[@]}" \
        --json "$OUT/moe-pallas-scan.json" ;;
    moe)  # a Mixtral-shaped MoE against its dense twin (same active weights), tokens/s,
      # dropless as shipped (model.moe.grouped = "auto": the Pallas kernels on a Hopper GPU,
      # whose first compile took 145-170 s on an H200 on 2026-11-26)
      run moe-dropless 400 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --rounds 2 --steps 12 --warmup 4 \
        --json "$OUT/moe-dropless.json" ;;
    moebatch16)  # the same at 16 x 2048 (56.5 GiB planned for an H100): AdamW over the
      # experts' 3.3x parameters is per step, not per token
      run moe-dropless-b16 240 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --set train.global_batch=16 --rounds 2 --steps 12 \
        --warmup 4 --json "$OUT/moe-dropless-b16.json" ;;
    moevariants)  # first the default with while loops and conds recorded into command
      # buffers (CUDA graph conditional nodes; an XLA flag), which would take the spill
      # size's choice and the loop's condition off the host; then dropless without spill
      # tiles (the default until 2026-11-26's second GPU run), the spill capped at 16
      # tiles (the loop past them), less bulk, no bulk (every tile batched with gathered
      # weights), capacity 1.25 (drops), and jax.lax.ragged_dot handed to cuDNN's grouped
      # GEMM (an XLA flag). mixtral-mini's first 4 layers at init overflow a balanced bulk
      # by 4, 7, 8 and 13 tiles of 512. All on the tiles (model.moe.grouped = "tiles":
      # "auto" takes the Pallas kernels on a Hopper GPU)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
        run moe-dropless-cmdbuf-while 200 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --set 'model.moe.grouped="tiles"' --rounds 2 --steps 12 \
        --warmup 4 --json "$OUT/moe-dropless-cmdbuf-while.json"
      for split in "0 1" "0.25 1" "1.25 0.75" "1.25 0"; do
        read -r spill bulk <<< "$split"
        run "moe-dropless-spill$spill-bulk$bulk" 200 $MOE_MEM python3 \
          benchmarks/moe_vs_dense.py experiments/mixtral-mini.toml --set model.moe.spill=$spill \
          --set model.moe.bulk=$bulk --set 'model.moe.grouped="tiles"' --rounds 2 --steps 12 \
          --warmup 4 \
          --json "$OUT/moe-dropless-spill$spill-bulk$bulk.json"
      done
      run moe-capacity 180 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --set model.moe.capacity_factor=1.25 --rounds 2 \
        --steps 12 --warmup 4 --json "$OUT/moe-capacity.json"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_use_ragged_dot_fusion=true" \
        run moe-dropless-cudnn 200 $MOE_MEM python3 benchmarks/moe_vs_dense.py \
        experiments/mixtral-mini.toml --set 'model.moe.grouped="ragged_dot"' --rounds 2 \
        --steps 12 --warmup 4 --json "$OUT/moe-dropless-cudnn.json" ;;
    grouped)  # the experts' grouped MLP alone (routing skewed, then balanced) in each
      # split of bulk, spill and loop, beside dense ones of its FLOPs (mixtral-mini's shapes)
      for mode in "--mlp --skew 0.3" "--mlp --skew 0"; do
        name=grouped$(echo "$mode" | tr -d ' -')
        run "$name" 150 python3 benchmarks/grouped_matmul.py $mode --repeat 10 \
          --json "$OUT/$name.json"
      done ;;
    profiles|profilemoe)  # where each step's GPU time goes, by kind and by kernel, the
      # GPU's idle gaps, each program run and the time by JAX operation
      # (benchmarks/kernel_profile.py: four traced steps, a summary in JSON; put its ops
      # beside the census's with benchmarks/ops_compare.py). On an H100 on 2026-11-26 the loop's steps took 3.5-4%
      # longer than two traced ones' span on all three models: do four traced steps run
      # alike, back to back, at the clock of the untraced ones? profilemoe: mixtral-mini's
      # alone
      run profile-mixtral-mini 180 $MOE_MEM python3 benchmarks/kernel_profile.py \
        experiments/mixtral-mini.toml --steps 12 --window 6:10 --top 60 \
        --json "$OUT/profile-mixtral-mini.json"
      [ "$stage" = profilemoe ] && continue
      run profile-gpt124 120 python3 benchmarks/kernel_profile.py experiments/gpt2-124m.toml \
        --steps 12 --window 6:10 --top 60 --json "$OUT/profile-gpt124.json"
      run profile-gpt1p3b 210 python3 benchmarks/kernel_profile.py experiments/gpt2-1.3b.toml \
        --steps 12 --window 6:10 --top 60 --json "$OUT/profile-gpt1p3b.json" ;;
    sweep124)  # issue 29's sweep item: predicted against measured on one GPU. One device
      # has one mesh shape, so the sweep tries settings on it (--vary), compiles each on
      # the GPU, trains the top ones (each in a process of its own) and fits the
      # overheads to them
      run sweep-124m 560 python3 -m plait sweep experiments/gpt2-124m.toml --devices 1 \
        --hardware auto --vary model.remat=none,save_attention,full \
        --vary model.loss_chunks=1,4 --run --top 3 --out "$OUT/sweep-124m" ;;
    sweep1p3b)  # the same, and issue 29's remat policy chosen by measurement; no remat
      # at all may fit since norms and activations keep only their inputs (40 GiB of
      # activations at 16 x 1024 in 4 loss pieces, was 106: docs/architecture.md)
      run sweep-1p3b 560 python3 -m plait sweep experiments/gpt2-1.3b.toml --devices 1 \
        --hardware auto --vary model.remat=none,save_dots,save_attention,full \
        --vary model.loss_chunks=4 --run --top 3 --out "$OUT/sweep-1p3b" ;;
    sweepllama)  # issue 29's remat policy for llama3.2-1b, chosen by measurement
      run sweep-llama1b 560 python3 -m plait sweep experiments/llama3.2-1b.toml --devices 1 \
        --hardware auto --vary model.remat=save_dots,save_attention,full \
        --vary model.loss_chunks=1,8 --run --top 3 --out "$OUT/sweep-llama1b" ;;
    *) echo "unknown stage $stage (env pallas moepallas moepallasscan cmdbuf cbregions dlrm gpt124 kernelcheck kernels kernels1p3b normkernel losskernel ab124 abmoe gpt124scan nanogpt nanogptxla nanogptnocmdbuf gpt1p3b gpt1p3bstart gpt1p3bunrolled gpt1p3bnoremat llama1b
       llama1bchunks fp8 fp8unrolled fp8scanned fp8curve fp8kernelcheck fp8kernel fp8cache moe moebatch16 moevariants grouped profiles profilemoe sweep124 sweep1p3b sweepllama)"
       exit 2 ;;
  esac
done
