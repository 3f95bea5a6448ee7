"""Run in a subprocess with 4 fake CPU devices (tests/test_tree_engine.py): tree verification sharded over
data=2,tensor=2 gives the same tokens and acceptance lengths as one device (oracle proposer with planted
errors, so the accepted paths leave the chain; greedy). Prints one JSON object."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax import sharding  # noqa: E402
from dflash_jax.engine.generate import DecodeSettings, generate  # noqa: E402
from dflash_jax.engine.proposers import NoProposer, OracleProposer  # noqa: E402
from dflash_jax.sharding import make_mesh  # noqa: E402
from engine_tiny import planted_schedule, tiny_target  # noqa: E402

tc, tp = tiny_target()
rng = np.random.default_rng(0)
prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 13, 9, 21)]
ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=20))
reference, errors = planted_schedule(prompts, ar.tokens, [[2, 3, 1] * 8] * len(prompts), 8, 96)
oracle = OracleProposer(8, tc.vocab_size)
runs = {}
for name, spec in (("one", None), ("data2_tensor2", "data=2,tensor=2")):
    mesh = make_mesh(spec) if spec else None
    params = tp if mesh is None else jax.device_put(tp, sharding.tree_shardings(tp, mesh))
    r = generate(tc, params, prompts, oracle, oracle.init(reference, errors),
                 DecodeSettings(max_new_tokens=20, tree_budget=24, mesh=mesh))
    runs[name] = {"tokens": r.tokens, "accept": r.accept_lengths}
print(json.dumps({"devices": jax.device_count(), "ar": ar.tokens, "runs": runs}))
