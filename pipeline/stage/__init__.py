"""A pipeline stage: the Hugging Face model's own modules cut out (``model``), its weights
(``weights``), and how its layers compute: attention without a score matrix (``attention``),
tiled MLPs (``tiled``), sequence segments that carry keys and values (``segments``) and the
mixture-of-experts router loss across stages (``router_loss``)."""
