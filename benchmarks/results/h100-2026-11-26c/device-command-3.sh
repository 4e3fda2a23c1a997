#!/usr/bin/env bash
# this session's second device command: profiles with the GPU's idle gaps
set -u
D=/tmp/g; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
NOW=$PWD/src:/tmp/site BEFORE=$PWD/.refs/plait-before/src:/tmp/site
T0=$SECONDS
run() { local name=$1 limit=$2; shift 2; local left=$((${DEADLINE_S:-400} - (SECONDS - T0)))
  if [ $left -lt 40 ]; then echo "== $name skipped"; return; fi
  [ $left -lt $limit ] && limit=$left
  echo "== $name ($limit s)"; timeout $limit "$@" > $D/$name.log 2>&1; echo "== $name exit $? after $((SECONDS - T0)) s"
  python3 - $D/$name.json <<'P'
import json, sys
try: p = json.load(open(sys.argv[1]))
except Exception as e: print("no json", e); sys.exit()
print({k: p.get(k) for k in ("step_ms", "busy_ms_per_step", "span_ms_per_step", "idle_ms_per_step", "kernels_per_step", "host_round_trips_per_step", "kernels_under_5us_per_step")})
print(p.get("kinds_ms_per_step")); print(p.get("idle_by_gap"))
for g in p.get("largest_gaps", [])[:5]: print(g["us"], g["after"][:60], "->", g["before"][:60])
P
}
run profile-gpt124-now 90 env PYTHONPATH=$NOW python3 benchmarks/kernel_profile.py experiments/gpt2-124m.toml --top 60 --json $D/profile-gpt124-now.json
run profile-gpt124-before 90 env PYTHONPATH=$BEFORE python3 benchmarks/kernel_profile.py experiments/gpt2-124m.toml --top 60 --json $D/profile-gpt124-before.json
run profile-gpt1p3b 150 env PYTHONPATH=$NOW python3 benchmarks/kernel_profile.py experiments/gpt2-1.3b.toml --top 60 --json $D/profile-gpt1p3b.json
run profile-mixtral-mini 150 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$NOW python3 benchmarks/kernel_profile.py experiments/mixtral-mini.toml --top 60 --json $D/profile-mixtral-mini.json
tar czf $OUT/gpu.tgz -C $D .
