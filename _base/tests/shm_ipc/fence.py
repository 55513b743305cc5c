"""`Fence`: what a CUDA event of a KV copy is to the ring, the receiver and the decode node's
intake (`query`, `synchronize`), for tests on machines without a GPU: done when the test says
so, or once waited for."""

from __future__ import annotations


class Fence:
    def __init__(self) -> None:
        self.done, self.waited = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True
