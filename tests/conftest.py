"""Tests run on 8 simulated CPU devices, fixed before JAX starts."""

import os
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).parent))
