"""A model's shapes and FLOPs as the cluster planner counts them: Megatron-LM's equation 3
for the GPT (Hugging Face configs: tests/planning/test_hf_config.py)."""

import pytest

from gpipe.planning.cluster_step import step_flops
from gpipe.planning.transformer import gpt_shape


@pytest.mark.parametrize("layers, hidden, heads", [(24, 2304, 24), (128, 25600, 160)])
def test_the_gpt_counts_megatrons_equation_3(layers, hidden, heads):
    b, s, v = 512, 2048, 51200
    shape = gpt_shape(layers, hidden, heads, v)
    equation_3 = (
        96 * b * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    )
    hardware, model = step_flops(shape, b * s, s, "full")
    assert hardware == pytest.approx(equation_3, rel=1e-12)
    assert model == pytest.approx(equation_3 * 3 / 4 + 6 * b * s * hidden * v / 4, rel=1e-12)
    assert step_flops(shape, b * s, s, "none") == (model, model)
