"""Where bytes go: the buffers of one rank (`KVArgs`), who talks to whom under a TP mismatch, and
the (src, dst, length) descriptors of one chunk.

A hybrid model's recurrent state moves with a request's last chunk, one slot per request: the
prefill rank's `RecurrentState` slot into the decode rank's. Its heads split over TP like KV
heads (`total_state_heads // tp` per rank, no replicas), so under a TP mismatch a prefill rank
writes, per layer, its heads at their offset in the decode rank's slot.

With speculative decoding (runtime/speculative.py) the draft layer's KV buffers follow the
target's in the buffer list (its pages move with theirs), and each request's last hidden state,
one row of the hidden-state buffer at its state slot, moves whole with its last chunk (every
TP rank holds the whole row).

A KV buffer is `[num_pages, page_size, heads, head_dim]` (see runtime/model/kv_cache.py): page `p` is
`ptr + p * item_len`, token `t` of it `+ t * item_len / page_size`, and head `h` of that token
`+ h * head_bytes`.

TP mismatch (prefill TP = n, decode TP = m, total KV heads H): a rank holds
`max(1, H // tp)` heads starting at `tp_rank * H // tp` (ranks beyond H hold replicas). Each
decode rank contacts either its one prefill rank (n <= m) or a group of n / m ranks (n > m); in a
group, a rank that would only repeat heads already covered (always so for MLA, where every rank
holds the same latent) is a *dummy*: it sends no bytes but still reports success.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdsim.core.pages import group_contiguous_runs


@dataclass(frozen=True)
class KVArgs:
    """The registered memory of one rank, and enough of the model to map heads across TP."""

    kv_data_ptrs: tuple[int, ...]
    kv_data_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]  # bytes per page, per buffer
    metadata_ptr: int
    metadata_len: int
    metadata_item_len: int
    page_size: int
    kv_dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: int = 1
    kv_heads_per_rank: int = 1
    is_mla: bool = False
    dp_rank: int = 0
    dp_size: int = 1
    # The recurrent-state buffer of a hybrid model (runtime/model/hybrid.py `RecurrentState`;
    # all 0 without one): `state_len` bytes of slots of `state_slot_len` bytes, each holding
    # `state_layers` layers x this rank's `total_state_heads // tp_size` heads, head-contiguous.
    state_ptr: int = 0
    state_len: int = 0
    state_slot_len: int = 0
    state_layers: int = 0
    total_state_heads: int = 0
    # The draft's hidden-state buffer of a speculating rank (0 without one): `hidden_len`
    # bytes of rows of `hidden_slot_len` bytes, one per state slot.
    hidden_ptr: int = 0
    hidden_len: int = 0
    hidden_slot_len: int = 0
    # Whatever owns the memory above (tensors, arrays): held so it lives as long as these args
    # (and so the manager holding them). Mooncake writes into registered memory blindly, so
    # freeing it while registered corrupts the heap.
    owners: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        n = len(self.kv_data_ptrs)
        if not n or len(self.kv_data_lens) != n or len(self.kv_item_lens) != n:
            raise ValueError("kv_data_ptrs, kv_data_lens and kv_item_lens must be non-empty and "
                             f"of one length, got {n}, {len(self.kv_data_lens)}, "
                             f"{len(self.kv_item_lens)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for i, (length, item) in enumerate(zip(self.kv_data_lens, self.kv_item_lens)):
            if item <= 0 or length % item or item % self.page_size:
                raise ValueError(f"buffer {i}: {length} bytes of {item}-byte pages of "
                                 f"{self.page_size} tokens do not divide evenly")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} not in 0..{self.tp_size - 1}")
        if not self.is_mla:
            head_range(self.tp_rank, self.tp_size, self.total_kv_heads)  # divisibility check
            want = heads_per_rank(self.tp_size, self.total_kv_heads)
            if self.kv_heads_per_rank != want:
                raise ValueError(f"kv_heads_per_rank must be max(1, {self.total_kv_heads} // "
                                 f"{self.tp_size}) = {want}, got {self.kv_heads_per_rank}")
            for i, item in enumerate(self.kv_item_lens):
                if (item // self.page_size) % self.kv_heads_per_rank:
                    raise ValueError(f"buffer {i}: a token slot of {item // self.page_size} bytes "
                                     f"does not split into {self.kv_heads_per_rank} heads")
        if self.state_len:
            if self.state_layers < 1 or self.total_state_heads % self.tp_size:
                raise ValueError(f"a state of {self.state_layers} layers x "
                                 f"{self.total_state_heads} heads does not split over TP "
                                 f"{self.tp_size}")
            pieces = self.state_layers * self.state_heads_per_rank
            if (self.state_slot_len <= 0 or self.state_len % self.state_slot_len
                    or self.state_slot_len % pieces):
                raise ValueError(f"state: {self.state_len} bytes of {self.state_slot_len}-byte "
                                 f"slots of {pieces} heads do not divide evenly")

        if self.hidden_len:
            if self.hidden_slot_len <= 0 or self.hidden_len % self.hidden_slot_len:
                raise ValueError(f"hidden states: {self.hidden_len} bytes of "
                                 f"{self.hidden_slot_len}-byte rows do not divide evenly")
            if self.state_len and self.num_state_slots != self.hidden_len // self.hidden_slot_len:
                raise ValueError("the recurrent-state and hidden-state buffers differ in slots")

    @property
    def state_heads_per_rank(self) -> int:
        return self.total_state_heads // self.tp_size

    @property
    def num_state_slots(self) -> int:
        return num_state_slots(self)

    @classmethod
    def for_cache(cls, cache, metadata, *, tp_rank: int = 0, tp_size: int = 1,
                  total_kv_heads: int | None = None, dp_rank: int = 0, dp_size: int = 1,
                  speculation=None) -> KVArgs:
        """From a `runtime.model.kv_cache.PagedKVCache` (with its recurrent state, if any) and a
        `MetadataBuffer`; a GQA cache needs the model's `total_kv_heads` (a rank's own count may
        be a replica). `speculation` (a `runtime.speculative.DecodeSpeculation`) adds the
        draft's KV buffers and its hidden-state buffer."""
        if not cache.mla and total_kv_heads is None:
            raise ValueError("KVArgs.for_cache: pass total_kv_heads for a GQA cache")
        total = 1 if cache.mla else total_kv_heads
        state = cache.state
        state_fields = {} if state is None else dict(
            state_ptr=state.data_ptr(), state_len=state.data_len(),
            state_slot_len=state.slot_bytes(), state_layers=state.num_layers,
            total_state_heads=state.heads * tp_size)
        caches = [cache] if speculation is None else [cache, speculation.kv]
        if speculation is not None:
            hidden = speculation.hidden
            state_fields.update(hidden_ptr=hidden.data_ptr(),
                                hidden_len=hidden.numel() * hidden.element_size(),
                                hidden_slot_len=hidden[0].numel() * hidden.element_size())
        return cls(
            **state_fields,
            kv_data_ptrs=[p for c in caches for p in c.data_ptrs()],
            kv_data_lens=[n for c in caches for n in c.data_lens()],
            kv_item_lens=[n for c in caches for n in c.item_lens()], metadata_ptr=metadata.ptr,
            metadata_len=metadata.nbytes, metadata_item_len=metadata.item_len,
            page_size=cache.page_size, kv_dtype=str(cache.dtype).removeprefix("torch."),
            tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total,
            kv_heads_per_rank=cache.heads, is_mla=cache.mla, dp_rank=dp_rank, dp_size=dp_size,
            owners=(cache, metadata, speculation))


def num_state_slots(args) -> int:
    """The state slots of a rank's `KVArgs` or `RegisterDecode`: its recurrent-state or
    hidden-state buffer's (0 without either)."""
    if args.state_len:
        return args.state_len // args.state_slot_len
    return args.hidden_len // args.hidden_slot_len if args.hidden_len else 0


def heads_per_rank(tp_size: int, total_heads: int) -> int:
    return max(1, total_heads // tp_size)


def head_range(tp_rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """`(first head, count)` that `tp_rank` of `tp_size` holds."""
    if total_heads < 1 or (total_heads % tp_size and tp_size % total_heads):
        raise ValueError(f"{total_heads} KV heads cannot be split over TP {tp_size}: one must "
                         "divide the other")
    return tp_rank * total_heads // tp_size, heads_per_rank(tp_size, total_heads)


def check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ValueError(f"prefill TP {prefill_tp} and decode TP {decode_tp}: one must divide "
                         "the other")


@dataclass(frozen=True, slots=True)
class Target:
    prefill_tp_rank: int
    is_dummy: bool


def plan_targets(decode_rank: int, decode_tp: int, prefill_tp: int, *, is_mla: bool,
                 total_heads: int) -> list[Target]:
    """The prefill TP ranks one decode rank asks for its KV."""
    check_tp_sizes(prefill_tp, decode_tp)
    if prefill_tp <= decode_tp:
        return [Target(decode_rank * prefill_tp // decode_tp, is_dummy=False)]
    group = prefill_tp // decode_tp
    if is_mla:
        return [Target(p, is_dummy=i > 0)
                for i, p in enumerate(range(decode_rank * group, (decode_rank + 1) * group))]
    covered: set[int] = set()
    targets = []
    for p in range(decode_rank * group, (decode_rank + 1) * group):
        start, count = head_range(p, prefill_tp, total_heads)
        heads = set(range(start, start + count))
        targets.append(Target(p, is_dummy=heads <= covered))
        covered |= heads
    return targets


def decode_ranks_per_prefill_rank(prefill_tp: int, decode_tp: int) -> int:
    """How many decode ranks send transfer info for one room to one prefill rank."""
    check_tp_sizes(prefill_tp, decode_tp)
    return max(1, decode_tp // prefill_tp)


# ---- descriptors -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Per token slot: copy `length` bytes from `src_offset` to `dst_offset`."""

    src_offset: int
    dst_offset: int
    length: int


def head_slice(src_heads: tuple[int, int], dst_heads: tuple[int, int],
               head_bytes: int) -> HeadSlice | None:
    """The overlap of two head ranges, as byte offsets inside each side's token slot."""
    lo = max(src_heads[0], dst_heads[0])
    hi = min(src_heads[0] + src_heads[1], dst_heads[0] + dst_heads[1])
    if lo >= hi:
        return None
    return HeadSlice((lo - src_heads[0]) * head_bytes, (lo - dst_heads[0]) * head_bytes,
                     (hi - lo) * head_bytes)


Descriptors = tuple[list[int], list[int], list[int]]


def page_descriptors(src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages) -> Descriptors:
    """Whole pages, one descriptor per run contiguous on both sides, per buffer."""
    runs = np.array(group_contiguous_runs(src_pages, dst_pages), dtype=np.int64).reshape(-1, 3)
    srcs, dsts, lens = [], [], []
    for src_ptr, dst_ptr, item in zip(src_ptrs, dst_ptrs, item_lens):
        srcs.append(src_ptr + runs[:, 0] * item)
        dsts.append(dst_ptr + runs[:, 1] * item)
        lens.append(runs[:, 2] * item)
    return _flat(srcs), _flat(dsts), _flat(lens)


def head_slice_descriptors(src_ptrs, src_item_lens, dst_ptrs, dst_item_lens, page_size: int,
                           src_pages, dst_pages, piece: HeadSlice) -> Descriptors:
    """One descriptor per token slot per buffer: this rank's heads inside the peer's slot."""
    src_pages = np.asarray(src_pages, dtype=np.int64)[:, None]
    dst_pages = np.asarray(dst_pages, dtype=np.int64)[:, None]
    tokens = np.arange(page_size, dtype=np.int64)[None, :]
    srcs, dsts = [], []
    for src_ptr, s_item, dst_ptr, d_item in zip(src_ptrs, src_item_lens, dst_ptrs, dst_item_lens):
        s_slot, d_slot = s_item // page_size, d_item // page_size
        srcs.append((src_ptr + src_pages * s_item + tokens * s_slot + piece.src_offset).ravel())
        dsts.append((dst_ptr + dst_pages * d_item + tokens * d_slot + piece.dst_offset).ravel())
    n = sum(len(s) for s in srcs)
    return _flat(srcs), _flat(dsts), [piece.length] * n


def state_descriptors(src_ptr: int, src_slot_len: int, dst_ptr: int, dst_slot_len: int,
                      layers: int, src_slots, dst_slots, piece: HeadSlice | None) -> Descriptors:
    """A request's recurrent state: whole slots (`piece` None: same heads on both sides), else
    per slot and layer this rank's heads at their offset in the peer's layer."""
    srcs, dsts, lens = [], [], []
    for src, dst in zip(src_slots, dst_slots):
        if piece is None:
            srcs.append(src_ptr + src * src_slot_len)
            dsts.append(dst_ptr + dst * dst_slot_len)
            lens.append(src_slot_len)
            continue
        src_layer, dst_layer = src_slot_len // layers, dst_slot_len // layers
        for layer in range(layers):
            srcs.append(src_ptr + src * src_slot_len + layer * src_layer + piece.src_offset)
            dsts.append(dst_ptr + dst * dst_slot_len + layer * dst_layer + piece.dst_offset)
            lens.append(piece.length)
    return srcs, dsts, lens


def hidden_descriptors(src_ptr: int, dst_ptr: int, slot_len: int, src_slots,
                       dst_slots) -> Descriptors:
    """A request's last hidden state (speculative decoding): its whole row, slot to slot."""
    return ([src_ptr + s * slot_len for s in src_slots],
            [dst_ptr + d * slot_len for d in dst_slots], [slot_len] * len(src_slots))


def _flat(parts: list[np.ndarray]) -> list[int]:
    return np.concatenate(parts).tolist() if parts else []
