"""What a request asks of the decode nodes' KV cache, against what they report holding.

Each sequence needs its prompt and the max_tokens the client asked for (its prompt and one token
when it asked none: it may still be cut short or preempted later), in whole blocks. `kv_tokens`
refuses with a 400 a request the decode nodes could never hold: a sequence larger than the
largest node's cache, or all its sequences together larger than all nodes'. What it returns
otherwise is what the request holds in the router's admission (`router.admission`) against
`budget`, the nodes' KV tokens (a worker's share of them), so that requests in flight never ask
more KV than there is. The nodes' sizes come from their heartbeats (`Backend.kv_blocks`); while unknown,
nothing is checked or counted.
"""

from __future__ import annotations

from router.errors import bad_param


def _block_size(nodes: list[tuple[int, int]]) -> int:
    return max(size for _, size in nodes)  # sequences take whole blocks


def _blocks(prompt_len: int, asked: int, block_size: int) -> int:
    return -(-(prompt_len + asked) // block_size)


def budget(nodes, share: float = 1.0) -> int | None:
    """KV tokens of every decode node taking requests, times `share`; None while unknown."""
    if not nodes:
        return None
    bs = _block_size(nodes)
    return int(sum(b * s for b, s in nodes) // bs * bs * share)


def kv_tokens(prompt_lens: list[int], max_tokens: int | None, nodes) -> int:
    """The KV tokens a request's sequences may fill (whole blocks; 0 while the nodes are
    unknown), after a 400 `kv_capacity_exceeded` for a request the decode nodes can never hold
    (see above)."""
    if not nodes:
        return 0
    bs = _block_size(nodes)
    asked = max_tokens if max_tokens is not None else 1
    need = [_blocks(n, asked, bs) for n in prompt_lens]
    largest, total = max(b * s for b, s in nodes) // bs, sum(b * s for b, s in nodes) // bs
    what = "the prompt and max_tokens" if max_tokens is not None else "the prompt"
    if max(need) > largest:
        raise bad_param("max_tokens" if max_tokens is not None else "prompt",
                        f"{what} of one sequence need {max(need) * bs} tokens of KV cache; the "
                        f"largest decode node holds {largest * bs}", "kv_capacity_exceeded")
    if sum(need) > total:
        raise bad_param("n", f"{len(prompt_lens)} sequences need {sum(need) * bs} tokens of KV "
                             f"cache ({what} of each); the decode nodes hold {total * bs}",
                        "kv_capacity_exceeded")
    return sum(need) * bs
