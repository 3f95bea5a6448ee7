"""The expert FFN alone against transformers' own blocks, with weights copied in: Qwen3-Next's sparse MoE
block (the shared expert scaled by ``sigmoid(shared_expert_gate(x))``, which Qwen3-Next and Qwen3.5-MoE
targets reuse) on all three compute paths. Tolerance 1e-5 absolute (fp32). The whole Qwen3-MoE and gpt-oss
decoders are compared with transformers in tests/test_target_parity.py."""

import numpy as np
import pytest

from dflash_jax.models.config import ExpertsConfig
from dflash_jax.models.experts import Experts, force_expert_path

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("path", ["dense", "grouped", "routed"])
def test_shared_expert_block_matches_qwen3_next(path):
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, norm_topk_prob=True)
    torch.manual_seed(0)
    block = qwen3_next.Qwen3NextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    sd = {k: v.numpy() for k, v in block.state_dict().items()}
    e, i = 6, 32
    gate_up = sd["experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    params = {
        "gate": {"kernel": sd["gate.weight"].T},
        "experts": {"gate_proj": gate_up[:, :i].transpose(0, 2, 1), "up_proj": gate_up[:, i:].transpose(0, 2, 1),
                    "down_proj": sd["experts.down_proj"].transpose(0, 2, 1)},
        "shared_expert": {name: {"kernel": sd[f"shared_expert.{name}.weight"].T}
                          for name in ("gate_proj", "up_proj", "down_proj")},
        "shared_expert_gate": {"kernel": sd["shared_expert_gate.weight"].T},
    }
    x = np.random.default_rng(1).standard_normal((2, 7, 64)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
    ecfg = ExpertsConfig(num_experts=e, top_k=2, intermediate_size=i, norm_topk_prob=True,
                         shared_intermediate_size=48)
    with force_expert_path(path):
        got = np.asarray(Experts(ecfg).apply({"params": params}, x))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
