"""OLMo 2: RMSNorms after the attention and the MLP (none before), q and k normalised over all
heads at once."""
from functools import partial

from models.spec import ArchSpec, llama_layer_shape

SPEC = ArchSpec(
    family="OLMo 2", model_types=("olmo2",), config_class="Olmo2Config", sliding="none",
    examples="OLMo-2 1B/7B/13B/32B",
    tiny=dict(),
    layer_shape=partial(llama_layer_shape, pre_norms=0, post_norms=2, qk_norm="all", norm_fp32_out=True),
)
