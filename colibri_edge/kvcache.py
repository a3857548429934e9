"""Paged KV cache bookkeeping (DESIGN.md, "Memory"): the block pool and per-sequence block tables.

The backend holds the K/V storage ([num_blocks * B, Hkv, D] per layer); this module only decides
which slots a sequence's tokens occupy. A token at position p of a sequence lives in slot
    block_table[p // B] * B + p % B.
Blocks are handed out on demand and returned the moment a sequence is freed.
"""
from __future__ import annotations

from .errors import ColibriError, COLIBRI_ERR_OUT_OF_MEMORY


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a stack, lowest id on top: reuse is deterministic and recently freed blocks stay warm
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, have: int, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - have)

    def grow(self, table: list, tokens: int, who: str = "sequence"):
        """Extend `table` so it covers `tokens` positions; all or nothing."""
        need = self.blocks_needed(len(table), tokens)
        if need > len(self._free):
            raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY,
                               f"KV cache pool exhausted: {who} needs {need} more block(s) of "
                               f"{self.block_size} tokens, {len(self._free)} free of {self.num_blocks}; "
                               "open the engine with a larger kv_cache_tokens or run fewer sequences at once")
        for _ in range(need):
            table.append(self._free.pop())

    def release(self, table: list):
        while table:
            self._free.append(table.pop())

    def slot(self, table: list, position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size
