"""Worker selection, pure: the cost function, the pick, the router knobs and the approximate cache.

For each candidate rank r the selection computes a cost in KV blocks and picks the cheapest one.
With the prompt's input length ``isl`` and the partition's block size ``bs``, P the prefill tokens
still pending on r, D its active blocks, ``new`` the prompt blocks not yet active there, A its
active requests and k the prompt's leading blocks that r recently received (the approximate
cache), the cost is ``SCALE * max(0, (P + isl)/bs - CREDIT * decay * k) + (D + new) + W * A``.
``CREDIT`` (``overlap_score_credit``, default 1.0) is how many prefill blocks each cached block
saves; ``SCALE`` (``prefill_load_scale``, 1.0; the old ``overlap_score_weight`` is an alias)
weighs prefill against decode memory; ``W`` (``decode_active_request_weight``, 0.0) charges each
running request; ``DECAY`` (``overlap_score_credit_decay``, 0.0) shrinks the cache credit on ranks
whose prefill backlog exceeds the least-loaded candidate's, ``decay = 1 / (1 + DECAY * ((P -
min P)/bs) / ceil(isl/bs))``, so a hot cache on a busy rank counts for less. With
``track_prefill_tokens`` off, bookings add no P, a rank's pending prefill tokens are no load
(P counts as 0) and the decay is 1, but the ``isl/bs - k`` term stays. At temperature 0 the minimum cost wins and exact ties are broken uniformly at random; at
``router_temperature`` T > 0 a rank is drawn with probability proportional to
``exp(-(cost - min) / ((max - min) * T))``. A request may override CREDIT, SCALE, T and the
tracking flags with ``router_config_override``, restrict the candidates with
``allowed_worker_ids`` or force one rank with ``pinned_worker``.

Nothing here knows HTTP, Redis or asyncio: time is passed in (integer nanoseconds) and randomness
comes from an injected ``random.Random``.
"""

from .approx_cache import ApproximateCache, CachedBlock, StoredRun, chain_keys
from .config import RouterConfig, RouterConfigOverride
from .cost import (
    RankInput,
    effective_prefill_tokens,
    potential_prefill_tokens,
    rank_logit,
    rank_logits,
    request_blocks,
    response_decode_blocks,
)
from .prompt import Prompt, normalize_prompt, prompt_from_hashes, prompt_from_tokens
from .selector import Selection, WorkerOverlap, select, softmax_probabilities

__all__ = [
    "ApproximateCache",
    "CachedBlock",
    "Prompt",
    "RankInput",
    "RouterConfig",
    "RouterConfigOverride",
    "Selection",
    "StoredRun",
    "WorkerOverlap",
    "chain_keys",
    "effective_prefill_tokens",
    "normalize_prompt",
    "potential_prefill_tokens",
    "prompt_from_hashes",
    "prompt_from_tokens",
    "rank_logit",
    "rank_logits",
    "request_blocks",
    "response_decode_blocks",
    "select",
    "softmax_probabilities",
]
