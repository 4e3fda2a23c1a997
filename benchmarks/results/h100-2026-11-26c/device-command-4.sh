#!/usr/bin/env bash
# this session's third device command: the loop's log cadence, MoE conds in command buffers
set -u
D=/tmp/g; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache PYTHONPATH=$PWD/src:/tmp/site
T0=$SECONDS
run() { local name=$1 limit=$2; shift 2; local left=$((${DEADLINE_S:-160} - (SECONDS - T0)))
  if [ $left -lt 25 ]; then echo "== $name skipped"; return; fi
  [ $left -lt $limit ] && limit=$left
  timeout $limit "$@" > $D/$name.log 2>&1; echo "== $name exit $? after $((SECONDS - T0)) s"
  grep -E '"(median_step_s|tokens_per_s|mfu|log_every|peak_device_memory_gib|steps_timed)"' $D/$name.log | tr -d '\n'; echo
}
run gpt124-every10 60 python3 benchmarks/throughput.py experiments/gpt2-124m.toml --steps 40 --warmup 2 --log-every 10
run gpt124-every1 50 python3 benchmarks/throughput.py experiments/gpt2-124m.toml --steps 30
run moe-cmdbuf 70 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL python3 benchmarks/throughput.py experiments/mixtral-mini.toml --steps 14 --warmup 4
run moe-plain 70 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 benchmarks/throughput.py experiments/mixtral-mini.toml --steps 14 --warmup 4
tar czf $OUT/gpu.tgz -C $D .
