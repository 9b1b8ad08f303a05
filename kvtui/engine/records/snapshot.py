"""Frozen, plain-Python views of the session that the UI, the trace and the tests read.

Nothing here holds a tensor: every field is an int, float, str, bool, tuple or None, so a snapshot
can cross threads, be coalesced, be written to JSON and compared in tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, TypeVar

from .codes import check_code

if TYPE_CHECKING:
    from typing import dataclass_transform  # Python 3.11: for the checker only, the engine imports on 3.10
else:

    def dataclass_transform(**_options):
        return lambda function: function


_T = TypeVar("_T")

# Where a cached token came from.
ORIGINS = (
    "template",
    "system",
    "user",
    "assistant",
    "forced",
    "tokenizer-added",
    "primed",
    "fed",
    "pad",
    "unknown",
)  # fed / pad: tokens a watched program fed (pad: masked out by its attention
# mask); unknown: in a watched cache before kvtui saw it (its id is -2)
SEVERITIES = ("info", "warning", "error")


# type checkers read a class under @frozen as the frozen dataclass it is (nothing at run time)
@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def frozen(cls: type[_T]) -> type[_T]:
    """`@dataclass(frozen=True, slots=True)` with an __init__ that fills every slot through its descriptor in one
    C-level pass.

    The generated frozen __init__ calls object.__setattr__ once per field (~7 µs for a LayerInfo, paid
    per layer per step; ~20 µs for a StepSnapshot, one Python line per field); this one sets every field by its
    slot's member descriptor from C (map, chain: no Python line per field) and builds the same object: same
    fields, defaults and factories, and assigning to it afterwards still raises FrozenInstanceError."""
    made: Any = dataclass(frozen=True, slots=True)(cls)  # a new class (slots): its __init__ is replaced below
    setters = [made.__dict__[f.name].__set__ for f in fields(made)]
    made.__init__ = _bulk_init(made, setters)
    _SETTERS[made] = setters
    return made


_SETTERS: dict[type, list] = {}  # a @frozen class -> its slots' setters, in field order


def from_columns(cls: type[_T], count: int, columns: Sequence) -> list[_T]:
    """`count` instances of a @frozen class from one column per field, in field order (each at least `count`
    long): the objects its __init__ makes, their slots set by their descriptors in C-level passes (no Python line
    per instance)."""
    made = list(map(object.__new__, repeat(cls, count)))
    deque(chain.from_iterable(map(map, _SETTERS[cls], repeat(made), columns)), maxlen=0)
    return made


def fast_init(cls: type[_T]) -> type[_T]:
    """A (mutable, unslotted) dataclass whose __init__ fills the instance's __dict__ in one call, not one
    assignment per field: the same attributes, defaults and factories as the dataclass's own __init__ (for a
    record made on every step with many fields, most of them defaults)."""
    made: Any = cls
    names = tuple(f.name for f in fields(made))
    made.__init__ = _bulk_init(made, None, names)
    return made


def _bulk_init(made: Any, setters: list | None, names: tuple[str, ...] = ()):
    """The generated __init__ of a dataclass: its parameters as the dataclass's (defaults, factories), its body
    one C-level fill of every field in field order (`setters`: the slots' member descriptors' __set__; None: the
    instance's __dict__ updated with `names`), then __post_init__ if the class has one."""
    params, body, values = [], [], []
    cells: dict[str, Any] = {}
    for f in fields(made):
        if not f.init:
            cells[f"_make_{f.name}"] = f.default_factory
            values.append(f"_make_{f.name}()")
            continue
        if f.default is not MISSING:
            cells[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            cells[f"_make_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"    if {f.name} is _MISSING: {f.name} = _make_{f.name}()")
        else:
            params.append(f.name)
        values.append(f.name)
    row = f"({', '.join(values)},)" if values else "()"
    if setters is not None:  # setter_i(self, value_i) for every field, run by C (map, chain, a deque that keeps none)
        cells.update(_SETTERS=setters, _deque=deque, _chain=chain.from_iterable, _map=map, _repeat=repeat, _zip=zip)
        body.append(f"    _deque(_chain(_map(_map, _SETTERS, _repeat((self,)), _zip({row}))), maxlen=0)")
    else:
        cells.update(_NAMES=names, _zip=zip)
        body.append(f"    self.__dict__.update(_zip(_NAMES, {row}))")
    if hasattr(made, "__post_init__"):  # a check of the values (Diagnostic: a registered code)
        body.append("    self.__post_init__()")
    cells["_MISSING"] = MISSING
    source = (
        f"def make({', '.join(cells)}):\n"
        f"  def __init__(self, {', '.join(params)}):\n"
        + "\n".join("  " + line for line in body)
        + "\n  return __init__\n"
    )
    namespace: dict = {}
    exec(source, {}, namespace)  # noqa: S102  (generated from the class's own fields, as dataclasses does)
    init = namespace["make"](**cells)
    init.__qualname__ = f"{made.__qualname__}.__init__"
    return init


@frozen
class BufferToken:
    position: int  # the position id it was fed with (drives RoPE / learned positions)
    id: int
    piece: str  # decoded text of this single id, for display only (ids are the truth)
    special: bool
    origin: str  # one of ORIGINS
    turn: int  # index of the chat turn (user message count) it belongs to


def unknown_token(position: int) -> BufferToken:
    """A token a watched cache held before kvtui saw it: its position is known, its id is not."""
    return BufferToken(position=position, id=-2, piece="?", special=False, origin="unknown", turn=0)


class TokenBuffer(Sequence[BufferToken]):
    """An immutable view of the first `length` tokens of an append-only list.

    The session only ever appends to its list; a rewind starts a new list. So a view handed to the
    UI never changes under it, and building one costs O(1) instead of copying 100k tokens.
    """

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[BufferToken], length: int | None = None):
        self._items = items
        self._length = len(items) if length is None else length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)  # bounded by the view, O(slice)
            return self._items[start:stop:step]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        return self._items[index]

    def tail(self, count: int) -> list[BufferToken]:
        """Its last `count` tokens (a step's fed tokens), as `self[len(self) - count :]` gives them."""
        return self._items[max(0, self._length - count) : self._length]

    def __iter__(self) -> Iterator[BufferToken]:
        items = self._items
        for i in range(self._length):
            yield items[i]

    def ids(self) -> list[int]:
        return [t.id for t in self]

    def __repr__(self) -> str:
        return f"TokenBuffer(len={self._length})"


@frozen
class LayerInfo:
    index: int
    kind: str  # "full", "sliding", "static", "static-sliding", "quantized"; non-KV: "conv", "linear", "ssm";
    # a layer holding K/V and a recurrent state (Falcon-H1) is "full+ssm"
    k_shape: tuple[int, ...]  # [batch, kv_heads, slots, head_dim]; MLA: [batch, 1, slots, kv_lora_rank]
    v_shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int  # K + V storage actually allocated
    filled: int  # token slots holding real states
    capacity: int | None  # slots it can hold; None = grows without bound
    window: int | None  # sliding window, if any
    seen: int  # tokens this layer has been fed in total
    held_from: int  # first position it still holds (> 0 once a sliding layer evicted)
    # Additive fields (defaults keep older code and traces working):
    states: tuple[tuple[str, tuple[int, ...]], ...] = ()  # non-KV states by name: ("conv", shape), ("ssm", shape)
    state_bytes: int = 0  # storage of those states (included in `bytes`)
    quant_bits: int | None = None  # quantized K/V: bits per value (fp8: 8)
    quant_group: int | None = None  # quantization group size (None: per tensor)
    quant_bytes: int = 0  # storage of the quantized K/V, scales and zero points (included in `bytes`)
    residual: int = 0  # quantized layers: newest tokens still held in full precision
    residual_capacity: int | None = None  # tokens the full-precision window takes before it is quantized
    offloaded: bool = False  # the cache moves this layer off its compute device between uses
    # a compressed cache (a press evicted some): the logical positions it holds, as half-open runs [(start, stop)];
    # per KV head where heads hold different ones. None: the contiguous run held_from..seen
    held: tuple[tuple[int, int], ...] | None = None
    held_heads: tuple[tuple[tuple[int, int], ...], ...] | None = None

    def holds(self, position: int) -> bool:
        """Whether this layer still holds the K/V of the token at `position` (a place in the token buffer)."""
        if self.held is None:
            return position >= self.held_from
        return any(start <= position < stop for start, stop in self.held)

    @property
    def kept_fraction(self) -> float:
        """Tokens held over tokens fed (1.0 for a layer that evicted nothing): where heads hold different positions,
        the mean over KV heads of each head's own (a press that masks keys per head keeps the slots: its fraction
        is what the heads still attend to, not the slots)."""
        if not self.seen:
            return 1.0
        if self.held_heads:
            counts = [sum(stop - start for start, stop in head) for head in self.held_heads]
            return min(1.0, sum(counts) / len(counts) / self.seen)
        if self.held is not None:
            return min(1.0, sum(stop - start for start, stop in self.held) / self.seen)
        return min(1.0, self.filled / self.seen)


@frozen
class TopToken:
    id: int
    text: str
    logit: float
    prob: float
    rank: int = 0


@frozen
class Where:
    """Where a server's note points: the publisher, the cached chain it names, the token where the prompt left that
    chain, the new block that left it (a step's alarms need none: their step and the cache their message names)."""

    origin: str = ""
    chain: int = 0  # 0: none
    position: int = -1  # -1: none
    block: str = ""


@frozen
class Diagnostic:
    code: str  # registered in codes.CODES (the constructor refuses any other)
    severity: str  # one of SEVERITIES, as the code's rule allows
    message: str
    step: int  # the forward it fired at; a server's note: the applied batch that raised it (1-based)
    where: Where | None = None

    def __post_init__(self) -> None:
        check_code(self.code, self.severity)


@frozen
class RowView:
    """One batch row of a watched forward (batch > 1): what it fed and what its cache row holds."""

    row: int
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]  # applied
    topk: tuple[TopToken, ...]
    buffer: TokenBuffer = field(compare=False)
    request_id: str | None = None  # a continuous-batching forward: the request this row is (a lane)
    # its buffer's first tokens that a prefix match shared on the request's first forward (another request fed
    # them): the trace carries them once, there, so a replay or a viewer rebuilds the whole buffer
    shared_prefix: int = 0


@frozen
class RequestView:
    """One request (a lane) of a continuous-batching forward: many requests packed into one forward over a
    paged cache (transformers' generate_batch / `transformers serve --continuous-batching`)."""

    request_id: str  # the id transformers or the server gave it
    status: str  # what kvtui saw: waiting / prefilling / decoding / finished / failed
    phase: str  # this forward: prefill / prefill-chunk / decode, "" when it was not in this forward
    fed: int  # tokens this forward fed it (0: not in this forward)
    held: int  # tokens its cache holds after this forward (prompt + generated so far)
    prompt_length: int
    generated: int
    prefix_hit: int = 0  # prompt tokens it found already held (shared blocks), never recomputed
    recomputed: int = 0  # prompt tokens it prefilled that another request's blocks already held
    blocks: tuple[tuple[str, tuple[int, ...]], ...] = ()  # per cache group: (group, its block table)
    shared: int = 0  # of its blocks, how many other requests also reference (prefix sharing)
    requeued: int = 0  # times the scheduler sent it back to waiting (its blocks were needed: offloaded or soft reset)
    reprefilled: int = 0  # tokens it computed again after coming back


@frozen
class PagedGroupView:
    """One cache group of a paged cache (full or sliding attention layers): its blocks, used, shared, free."""

    name: str
    layers: int
    block_tokens: int  # tokens per block
    total: int
    used: int  # distinct blocks in live block tables
    free: int
    shared: int  # blocks referenced by more than one request
    cached: int  # blocks nobody references, kept for reuse (prefix cache)


@frozen
class AttentionDetail:
    """What the viewer shows beside `StepSnapshot.attention`: one layer's heads, all layers, regions' shares."""

    layer: int  # the layer the heads and groups are of
    heads: tuple[tuple[tuple[int, float], ...], ...]  # per query head: (position, weight), as `attention`
    groups: tuple[tuple[tuple[int, float], ...], ...]  # per KV head group (GQA: the mean of its query heads)
    all_layers: tuple[tuple[int, float], ...]  # the mean over every layer with attention
    # a partition of the positions (reading/attention_regions.py): "sink", "pad", "special", "last W", "system",
    # "unknown", "turn N", "this turn", each position in one (older traces: overlapping regions)
    regions: tuple[str, ...]
    shares: tuple[tuple[float, ...] | None, ...]  # per layer: the head-mean weight on each region (None: no attention)


@frozen
class StepSnapshot:
    step: int  # forward calls so far in this session, 1-based
    phase: str  # "prefill", "decode", "rewind"
    turn: int
    input_ids: tuple[int, ...]  # what this forward fed
    positions: tuple[int, ...]  # the position ids it was fed with
    cursor: int  # next position id the session will write
    cache_seq_length: int  # what the cache itself says (get_seq_length)
    capacity: int | None  # static capacity, None for dynamic
    layers: tuple[LayerInfo, ...]
    topk: tuple[TopToken, ...]  # raw model distribution
    topk_processed: tuple[TopToken, ...]  # after the sampler's LogitsProcessors
    watched: tuple[TopToken, ...]  # tokens the user asked to follow, wherever they rank
    chosen: TopToken | None  # the next token (sampled or forced), not yet in the cache
    chosen_forced: bool
    diagnostics: tuple[Diagnostic, ...]  # raised by this step
    forward_ms: float
    snapshot_ms: float
    buffer: TokenBuffer = field(compare=False)  # every token in the cache, in order
    turn_done: bool = False  # chosen is an end token (or max tokens reached)
    # opt-in (--attention / watch(attention=True)): the newest query's attention (batch row 0), one entry per
    # decoder layer (None: a layer with no attention, conv/SSM), each (buffer position, head-mean weight) pairs
    # by weight descending: at least the 8 largest and every one >= 0.01, over the positions that layer holds
    attention: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    attention_layer: int | None = None  # the layer whose per-head rows `attention_detail` holds
    attention_detail: AttentionDetail | None = None
    # capture on but this step carries no attention: why, in one line (a model whose attention bypasses the
    # interface kvtui captures from, a packed forward, a compressed cache's slots); None otherwise and in old traces
    attention_off: str | None = None
    # watched programs (kvtui.watch): what the caller asked for, next to what the model applied
    source: str = "session"  # "session" (kvtui's own chat) | "watch" (a probed program)
    caller: str | None = None  # "file.py:42": the line of the user's code that made this forward
    cache_id: str | None = None  # e.g. "DynamicCache#1": which cache object the forward used
    cache_length_before: int | None = None
    requested_positions: tuple[int, ...] | None = None  # position_ids the caller passed (row 0)
    requested_cache_position: tuple[int, ...] | None = None  # cache_position the caller passed
    positions_source: str | None = None  # how `positions` were read: rotary / embedding / derived
    batch: int = 1
    row: int = 0  # the batch row this snapshot's input_ids/positions/topk/buffer describe
    rows: tuple[RowView, ...] | None = None  # every row, when batch > 1
    # a watched cache's lineage: copied from `cache_parent` when it held `cache_copied_at` tokens; its first
    # `cache_unknown` tokens were written before kvtui saw it
    cache_parent: str | None = None
    cache_copied_at: int | None = None
    cache_unknown: int = 0
    model: str | None = None  # "model 1: draft" when a program runs several models
    recomputed: int = 0  # prefill tokens another cache of the same model already held (recomputed-prefix)
    thread: str | None = None  # the thread that called, off the main thread ("Thread-2 (generate), started at x.py:3")
    # continuous batching (a packed forward over a paged cache): every live request, the ones this forward fed
    # first in packing order, and the paged cache's groups; `rows` then holds one view per fed request
    requests: tuple[RequestView, ...] | None = None
    paged: tuple[PagedGroupView, ...] | None = None

    @property
    def lineage(self) -> str | None:
        """`DynamicCache#3 ← deepcopy of #1 at 32 tokens`; `DynamicCache#2 (5 tokens filled before kvtui saw it)`."""
        if self.cache_id is None:
            return None
        if self.cache_parent is not None:
            return f"{self.cache_id} ← copy of #{self.cache_parent.rsplit('#', 1)[-1]} at {self.cache_copied_at} tokens"
        if self.cache_unknown:
            return f"{self.cache_id} ({self.cache_unknown} tokens filled before kvtui saw it)"
        return self.cache_id

    def for_row(self, row: int) -> StepSnapshot:
        """The same step seen from another batch row (the TUI's row picker)."""
        if not self.rows or not 0 <= row < len(self.rows) or row == self.row:
            return self
        from dataclasses import replace

        view = self.rows[row]
        return replace(
            self,
            input_ids=view.input_ids,
            positions=view.positions,
            topk=view.topk,
            topk_processed=view.topk,
            buffer=view.buffer,
            row=row,
        )

    # --compile: whether this session runs decode steps compiled; compile_ms is set on a step whose
    # forward included compiling (its forward_ms is compile time then); recompiles: graphs after the first
    compiled: bool = False
    compile_ms: float | None = None
    recompiles: int = 0
    # --cache none: no cache object; this step was one full forward over the whole context (use_cache=False),
    # so there are no layers and cache_seq_length is 0; the buffer is the context the model re-read
    uncached: bool = False
    # tensor parallelism (torchrun): this rank's layers hold one shard of each layer's KV heads, of this many
    # ranks' (merged by the viewer from every rank's records, written to the trace by tree.merge); None: whole
    tensor_parallel: int | None = None
    # id -> bytes of the tokens whose decoded piece is not their bytes (part of a character split across tokens):
    # the source's whole table, shared and append-only (records/token_bytes.py); the record writes its own ids'
    token_bytes: Mapping[int, bytes] = field(default_factory=dict)
    # its trace line once serialised (trace.record_line), shared by the trace file and a viewer's pipe
    line: list = field(default_factory=list, init=False, compare=False, repr=False)

    @property
    def cache_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def kv_heads(self) -> int | None:
        """The model's KV heads per layer (layer 0, K [batch, kv_heads, slots, head_dim]): all ranks' shards
        together under tensor parallelism. None: no layer, or a layout with no head axis."""
        if not self.layers or len(self.layers[0].k_shape) != 4:
            return None
        return self.layers[0].k_shape[1] * (self.tensor_parallel or 1)


@frozen
class VerifyResult:
    max_abs_diff: float
    tolerance: float
    topk_agree: bool  # same top-k ids in the same order (near-ties aside)
    cached_top: tuple[int, ...]
    recomputed_top: tuple[int, ...]
    tokens: int  # how many tokens were recomputed
    ok: bool
    ms: float
    # a compressed cache (a press evicted positions): what the compression cost, not a mismatch. KL(full ‖
    # compressed) of the next-token distributions in nats, and whether both pick the same top-1; None otherwise
    compressed_kl: float | None = None
    compressed_top1: bool | None = None
    # a quantized cache: per layer, the largest |error| of the K and of the V attention got (dequantized, residual
    # included) against the full-precision recompute's, over the recompute's largest |value| (reading/verify.py)
    layer_errors: tuple[tuple[float, float], ...] | None = None
    # a compressed cache watched with --attention: per layer, the share of the newest query's attention that the
    # uncompressed recompute puts on the positions the layer no longer holds (None: a layer not measured)
    evicted_attention: tuple[float | None, ...] | None = None
