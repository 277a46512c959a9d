"""The K/V buffer shared by the attention layers of one LIMe forward pass.

Layout: keys and values each live in a tensor in which layer j's raw heads form the head block
``j * kv .. (j + 1) * kv`` of a head axis, so a layer's sources are one strided range of that axis,
read without copying. Where the head axis sits depends on how the weights vary, so that each read
mode is (batched) GEMMs on views (one per source range, or on the CPU a sum of pieces:
``CPU_HEADS_PER_GEMM``). On the CPU that tensor is stored in chunks of one piece's layers, with
the pieces cut at chunk boundaries: a whole buffer can lie above glibc's mmap threshold, so every step
would map and zero-fill it afresh, while chunks of a few MB are reused from the heap (bench/RESULTS.md,
"the K/V buffer in chunks").

- position-major ``[L * kv, B * T, head_dim]`` (static matrices, mode "matrix"): mixing with
  ``R [kv, S * kv]`` is one GEMM over a contiguous row range, and routed heads come out with
  ``head_dim`` innermost, as attention wants them;
- feature-major ``[L * kv, head_dim, B * T]`` (per-dim weights, one mixing matrix per feature): each
  feature's sources are a strided matrix with unit-stride rows, so the mix is one GEMM batched over
  features instead of a permuted copy of every source at every layer; its products are written in
  this layout, so the gradient w.r.t. a layer's raw K/V is a view ``(B, T, kv * head_dim)`` of one;
- position-outer ``[B * T, L * kv, head_dim]`` (per-position weights, the dynamic router): each
  position's sources are a ``[S * kv, head_dim]`` matrix with unit-stride rows, so the mix is one GEMM
  batched over positions, and the routed heads come out ``(B, T, kv, head_dim)`` as ``k_proj`` writes them.

The read itself, its autograd function and its compiled operators are ``lime_model.kv_read``'s; this
module holds the storage and the arithmetic both run (``read``, ``backward``).

Off the CPU, static matrix weights have their gradients computed by their sources' backward
(``defer_weight_grads``): a source then reads each reader's kept gradient once for both of its gradients
(``lime_model.kv_kernels``), where a reader's backward would read every source once more.
"""

from __future__ import annotations

import bisect
from functools import partial
from itertools import pairwise

import torch

from .kv_kernels import contiguous_runs, source_backward

LAYOUTS = {"matrix": "position-major", "per-dim": "feature-major", "per-position": "position-outer"}


# On the CPU, GEMMs with few output rows (kv) slow down at long inner dimensions (bench/RESULTS.md,
# "numbers that stood in code comments"), so CPU reads in the matrix and per-dim modes sum pieces of at
# most this many source heads.
CPU_HEADS_PER_GEMM = 16


def gemm_pieces(device: torch.device) -> bool:
    """Whether reads on ``device`` sum GEMMs over pieces of their sources (the CPU) rather than doing
    one GEMM per contiguous source range (other devices, where each GEMM is a kernel launch)."""
    return device.type == "cpu"


class KVBuffer:
    """Per-forward storage of every layer's raw K/V heads and, in backward, of the gradients w.r.t.
    every layer's routed K/V (``grad_out``), both in the layout of the module docstring.

    Args:
        num_layers: number of attention layers L.
        num_kv_heads: K/V heads per layer (``kv``).
        head_dim: features per head.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.kv, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layout = "position-major"  # fixed by the first write
        # [keys, values], each stored in chunks of chunk_layers layers (the last may hold fewer)
        self.data: list[list[torch.Tensor]] = []
        self.chunk_layers = num_layers
        # grad_out[i][r]: d loss / d layer r's routed keys (i = 0) or values (i = 1), stored as a
        # one-layer buffer in the same layout; None until r's backward has run in this pass
        self.grad_out: list[list[torch.Tensor | None]] = [[None] * num_layers for _ in range(2)]
        # off the CPU, the buffer of keys' and values' kept gradients that grad_out's entries view
        self.grad_data: list[torch.Tensor] | None = None
        # readers[j]: (reader layer r, r's routing weight, index of j in r's sources), one per reader
        self.readers: list[list[tuple[int, torch.Tensor | None, int]]] = [[] for _ in range(num_layers)]
        # under torch.compile: the graph's buffer, keys and values stacked (``routed_read``)
        self.tensor: torch.Tensor | None = None
        # the last layer whose backward ran in this pass (a backward operator's state, ``_read_backward``)
        self.last_backward = num_layers
        self.copy_grads = False  # keep copies of the incoming gradients (``store_grad_out``)
        # the layers whose weight gradients their sources' backward computes, their weights as the
        # model gave them (layer 0's read carries them: ``defer_weight_grads``; None in a compiled
        # backward), and the column blocks computed so far: weight_grads[r] = (how many sources r has,
        # {pos: the gradient w.r.t. r's block of source pos})
        self.deferred: dict[int, torch.Tensor | None] = {}
        self.weight_grads: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}
        # links[j]: a scalar output of layer j's read that its readers' reads take as an input, so that
        # autograd runs j's backward (which mixes the readers' gradients into j's raw K/V) whenever a
        # reader's runs, even if j's own routed K/V reach no loss (an intervention replaced them)
        self.links: list[torch.Tensor | None] = [None] * num_layers

    @classmethod
    def over(cls, data: torch.Tensor, kv: int, mode: str) -> KVBuffer:
        """A buffer whose keys and values are ``data[0]`` and ``data[1]``, one chunk each, in the
        layout of read ``mode`` (a compiled graph's buffer: ``routed_read``)."""
        layout = LAYOUTS[mode]
        heads = data.shape[2 if layout == "position-outer" else 1]
        buffer = cls(heads // kv, kv, data.shape[2 if layout == "feature-major" else 3])
        buffer.layout, buffer.data, buffer.copy_grads = layout, [[data[0]], [data[1]]], True
        return buffer

    def chunk_shape(self, layers: int, positions: int) -> tuple[int, int, int]:
        """The shape of a buffer chunk of ``layers`` layers over ``positions`` (B * T) in this layout."""
        heads = layers * self.kv
        return {
            "position-major": (heads, positions, self.head_dim),
            "feature-major": (heads, self.head_dim, positions),
            "position-outer": (positions, heads, self.head_dim),
        }[self.layout]

    def stored(self, chunks: list[torch.Tensor], start_layer: int, stop_layer: int) -> torch.Tensor:
        """The buffered heads of layers ``start_layer .. stop_layer - 1`` (within one chunk) of the keys
        or values ``chunks`` (an entry of ``data``), as ``block`` gives them: a view."""
        index, first = divmod(start_layer, self.chunk_layers)
        if stop_layer - start_layer + first > self.chunk_layers:
            raise ValueError(f"layers {start_layer}..{stop_layer - 1} span two buffer chunks")
        return self.block(chunks[index], first, first + stop_layer - start_layer)

    def block(self, data: torch.Tensor, start_layer: int, stop_layer: int) -> torch.Tensor:
        """The heads of layers ``start_layer .. stop_layer - 1`` in ``data`` (a buffer in this layout)
        as a view ``[n, *row]`` with the head axis first, whatever the layout."""
        heads = slice(start_layer * self.kv, stop_layer * self.kv)
        if self.layout == "position-outer":
            return data[:, heads].transpose(0, 1)
        return data[heads]

    def heads(self, rows: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """A ``(n, B, T, head_dim)`` view of ``n`` heads ``rows [n, *row]`` (as ``block`` gives)."""
        if self.layout == "feature-major":
            return rows.view(-1, self.head_dim, B, T).permute(0, 2, 3, 1)
        return rows.view(-1, B, T, self.head_dim)

    def attention_heads(self, rows: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """Routed heads ``rows [kv, *row]`` as attention reads them, ``(B, kv, T, head_dim)``: a view,
        except feature-major heads, copied to unit-stride features (given strided features, SDPA on
        the CPU takes its math path, which is slower and keeps each layer's attention matrix)."""
        heads = self.heads(rows, B, T).transpose(0, 1)
        return heads.contiguous() if self.layout == "feature-major" else heads

    def layers_per_gemm(self, device: torch.device, mode: str) -> int:
        """How many buffered layers one GEMM of a ``mode`` read covers (``CPU_HEADS_PER_GEMM``)."""
        if gemm_pieces(device) and mode != "per-position":
            return max(1, CPU_HEADS_PER_GEMM // self.kv)
        return self.num_layers

    def write(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, weight, sources, mode: str
    ) -> None:
        """Store layer ``layer_idx``'s raw ``keys``/``values``, each ``(B, T, kv * head_dim)``, and
        record the layer as a reader of its ``sources`` with routing ``weight``. The first write
        allocates the buffer in the layout of read ``mode`` (``LAYOUTS``)."""
        if not self.data:
            self.allocate(keys, mode, self.layers_per_gemm(keys.device, mode))
        self.put(layer_idx, keys, values)
        self.add_reader(layer_idx, weight, sources)

    @staticmethod
    def defers_weight_grads(device: torch.device) -> bool:
        """Whether reads on ``device`` can have their sources' backward compute static weights'
        gradients (``defer_weight_grads``): where the kept gradients form one buffer (off the CPU:
        ``gemm_pieces``) and gradients are on."""
        return torch.is_grad_enabled() and not gemm_pieces(device)

    def defer_weight_grads(self, weights: dict[int, torch.Tensor]) -> None:
        """Before layer 0's write: have the sources' backward compute the gradients of these layers'
        static ``"matrix"`` weights (``kv_kernels.source_backward``), where ``defers_weight_grads``;
        else nothing changes."""
        if weights and self.defers_weight_grads(next(iter(weights.values())).device):
            self.deferred = dict(weights)

    def pop_weight_grads(self, layers: list[int]) -> list[torch.Tensor | None]:
        """The weight gradients of deferred ``layers`` (``None`` for a layer whose backward did not run),
        each in its weight's dtype, its column blocks joined in one copy; they are dropped here."""
        out: list[torch.Tensor | None] = []
        for r in layers:
            if r not in self.weight_grads:
                out.append(None)
                continue
            n_sources, blocks = self.weight_grads.pop(r)
            some = next(iter(blocks.values()))
            # a source whose backward gave no block contributes zeros (made only then: a kernel on a GPU)
            parts = [blocks[pos] if pos in blocks else some.new_zeros(some.shape) for pos in range(n_sources)]
            joined = torch.cat(parts, 1)
            weight = self.deferred.get(r)
            out.append(joined if weight is None else joined.to(weight.dtype))
        return out

    def allocate(self, keys: torch.Tensor, mode: str, chunk_layers: int) -> None:
        """Allocate the buffer for raw ``keys`` like ``(B, T, kv * head_dim)``, in the layout of read
        ``mode`` (``LAYOUTS``), in chunks of ``chunk_layers`` layers."""
        B, T, _ = keys.shape
        self.layout, self.chunk_layers = LAYOUTS[mode], chunk_layers
        self.data = [
            [
                keys.new_empty(self.chunk_shape(min(chunk_layers, self.num_layers - first), B * T))
                for first in range(0, self.num_layers, chunk_layers)
            ]
            for _ in range(2)
        ]

    def put(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy layer ``layer_idx``'s raw ``keys``/``values``, each ``(B, T, kv * head_dim)``, into its block."""
        B, T, _ = keys.shape
        for store, x in zip(self.data, (keys, values), strict=True):
            block = self.stored(store, layer_idx, layer_idx + 1)
            if self.layout == "feature-major":  # [kv*hd, B*T]: a 2D transpose, faster than 4D
                block.view(-1, B * T).copy_(x.reshape(B * T, -1).t())
            else:
                self.heads(block, B, T).copy_(x.view(B, T, self.kv, self.head_dim).permute(2, 0, 1, 3))

    def add_reader(self, layer_idx: int, weight: torch.Tensor | None, sources: list[int]) -> None:
        """Record layer ``layer_idx`` as a reader of its ``sources`` with routing ``weight``, which the
        sources' backward mixes its gradients back through (``take_grad``). A source's readers stay in
        ascending order, in which consecutive readers are one range of kept gradients, read by one
        kernel or GEMM: the compiled backward records them from the last layer down."""
        if weight is not None:
            weight = _own_copy(weight)
        for pos, source in enumerate(sources):
            bisect.insort(self.readers[source], (layer_idx, weight, pos), key=lambda reader: reader[0])

    def read(self, data: list[torch.Tensor], layer_idx: int, weight, sources, mode: str) -> torch.Tensor:
        """Layer ``layer_idx``'s routed heads ``[kv, *row]`` from ``data`` (the keys or the values
        chunks): its ``sources``' heads mixed by ``weight`` (``None``: a copy of its own heads)."""
        if weight is None:
            return self.stored(data, layer_idx, layer_idx + 1).clone()
        columns = partial(_columns, weight, self.kv, mode)
        source = partial(self.stored, data)
        return _mix(columns, source, self.kv, contiguous_runs(sources), mode, self.chunk_layers)

    def store_grad_out(self, layer_idx: int, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep the gradients w.r.t. layer ``layer_idx``'s routed keys and values, each ``[kv, *row]``.

        On the CPU one tensor per layer, which the reads' pieces take one by one (``gemm_pieces``): the
        incoming gradient itself when autograd made it contiguous in the buffer's layout (nothing here
        writes to a kept gradient), else a copy; always a copy in a compiled graph (``copy_grads``),
        whose memory planner reuses an intermediate's storage after its last use there. Elsewhere a
        copy into ``grad_data``, one buffer for all layers allocated by the first layer to run backward
        (as large as the K/V buffer), so that the gradients of a layer's readers are one range that a
        GEMM reads in place, not a concatenated copy. Either way a gradient is kept until its reader's
        lowest source has read it (``take_grad``): with every layer reading layer 0, to the pass's end."""
        if not gemm_pieces(grads[0].device):
            if self.grad_data is None:
                positions = grads[0].shape[2 if self.layout == "feature-major" else 1]
                shape = self.chunk_shape(self.num_layers, positions)
                self.grad_data = [grads[0].new_empty(shape), grads[1].new_empty(shape)]
            for store, data, grad in zip(self.grad_out, self.grad_data, grads, strict=True):
                store[layer_idx] = self.block(data, layer_idx, layer_idx + 1).copy_(grad)
            return
        for store, grad in zip(self.grad_out, grads, strict=True):
            x = grad.transpose(0, 1) if self.head_axis else grad
            store[layer_idx] = (
                x.clone(memory_format=torch.contiguous_format) if self.copy_grads else x.contiguous()
            )

    @property
    def head_axis(self) -> int:
        return 1 if self.layout == "position-outer" else 0

    def kept(self, which: int, start_layer: int, stop_layer: int) -> torch.Tensor:
        """The kept gradients w.r.t. the routed keys (``which=0``) or values (1) of layers
        ``start_layer .. stop_layer - 1`` as heads ``[n, *row]`` (as ``block`` gives): a view, except
        several layers kept one tensor each (on the CPU), a concatenated copy."""
        if self.grad_data is not None:
            return self.block(self.grad_data[which], start_layer, stop_layer)
        joined = _joined(self.grad_out[which], self.head_axis, start_layer, stop_layer)
        return self.block(joined, 0, stop_layer - start_layer)

    def take_grad(self, layer_idx: int, mode: str, shape: torch.Size) -> list[torch.Tensor]:
        """Gradients w.r.t. layer ``layer_idx``'s raw keys and values, each of ``shape`` (B, T, kv*hd):
        the stored gradients of the layer's readers mixed back through their transposed weights."""
        kv, axis = self.kv, weight_axis(mode)
        readers = [(r, w, pos) for r, w, pos in self.readers[layer_idx] if self.grad_out[0][r] is not None]
        if self.deferred and mode == "matrix" and self.grad_data is not None:
            grads = self.fused_grads(layer_idx, readers, shape)
            self.free_kept(readers)
            return grads
        mixed = [(r, w, pos) for r, w, pos in readers if w is not None]
        # column block i maps reader mixed[i]'s routed heads back onto this layer's heads
        blocks = [w.narrow(axis, pos * kv, kv).transpose(axis - 1, axis) for _, w, pos in mixed]
        runs = contiguous_runs([r for r, _, _ in mixed])
        # on the CPU one GEMM per reader (as fast as pieces of a read there, per-position included, and
        # no copy); elsewhere one per run of readers, on a range of ``grad_data``
        step = 1 if gemm_pieces(self.data[0][0].device) else self.num_layers
        B, T, _ = shape
        grads = []
        for which in range(2):
            source = partial(self.kept, which)
            rows = _mix(partial(_joined, blocks, axis), source, kv, runs, mode, step) if mixed else None
            for r, w, _ in readers:
                if w is None:  # a reader of its own heads only (the layer itself): the identity
                    own = source(r, r + 1)
                    rows = own.clone() if rows is None else rows.add_(own)
            assert rows is not None  # every reader mixes or reads its own heads
            grads.append(self.heads(rows, B, T).permute(1, 2, 0, 3).reshape(shape))
        self.free_kept(readers)
        return grads

    def fused_grads(self, layer_idx: int, readers, shape) -> list[torch.Tensor]:
        """``take_grad`` for ``"matrix"`` reads with deferred weight gradients: one pass over the
        readers' kept gradients gives the raw K/V gradients and each deferred reader's weight gradient on
        this source's column block, kept in ``weight_grads`` until ``pop_weight_grads`` joins them."""
        kv, kept = self.kv, self.grad_data or []
        # stacked in the weights' dtype, cast once by ``source_backward`` (not once per reader)
        dtype = next((w.dtype for _, w, _ in readers if w is not None), kept[0].dtype)
        eye = torch.eye(kv, dtype=dtype, device=kept[0].device)
        columns = torch.stack(
            [eye if w is None else w.narrow(1, pos * kv, kv).to(dtype) for _, w, pos in readers]
        )
        layers = [r for r, _, _ in readers]
        grads, parts = [], []
        for rows, data in zip(kept, self.data, strict=True):
            source = self.stored(data, layer_idx, layer_idx + 1).flatten(1)
            grad, weight_grads = source_backward(rows.flatten(1), layers, columns, source, self.head_dim)
            grads.append(grad.view(shape))
            parts.append(weight_grads)
        summed = parts[0] + parts[1]  # keys' and values' parts
        for (r, w, pos), g in zip(readers, summed, strict=True):
            if r in self.deferred and w is not None:
                self.weight_grads.setdefault(r, (w.shape[1] // kv, {}))[1][pos] = g  # joined when popped
        return grads

    def free_kept(self, readers) -> None:
        """Drop the kept gradients that this source, their reader's lowest, was the last to read."""
        for r, _, pos in readers:
            if pos == 0:
                for store in self.grad_out:
                    store[r] = None  # free it; a retained graph's next backward starts afresh
        if all(g is None for g in self.grad_out[0]):
            self.grad_data = None

    def backward(
        self, layer: int, grads: tuple[torch.Tensor, torch.Tensor], runs, mode: str, shape, weight_grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s backward, once every reader of it has run its own: keep ``grads`` (w.r.t.
        its routed keys and values, ``[kv, *row]``), and return the gradients w.r.t. its weight (when
        ``weight_grad``; its sources ``runs``, ``contiguous_runs``) and its raw keys and values (``shape``)."""
        self.store_grad_out(layer, grads)
        # the kept copies, contiguous in the buffer's layout: the weight gradient's batched GEMMs
        # read them without copying each batch slice (as they would from a strided incoming gradient)
        kept = [self.kept(which, layer, layer + 1) for which in range(2)]
        grad_w = None
        if weight_grad and layer not in self.deferred:
            grad_k_w, grad_v_w = (
                _weight_grad(g, data, self, runs, mode) for g, data in zip(kept, self.data, strict=True)
            )
            grad_w = grad_k_w.add_(grad_v_w)  # both fresh: summed in place
        grad_k, grad_v = self.take_grad(layer, mode, shape)
        return grad_w, grad_k, grad_v


def _own_copy(weight: torch.Tensor) -> torch.Tensor:
    """A routing weight as the buffer keeps it for its sources' backward (``KVBuffer.take_grad``).

    Detached: a per-position weight's graph leads back through earlier layers to the autograd nodes
    that hold this buffer, and a reference from here would close a cycle that keeps every step's
    graph alive until Python's cycle collector runs. Copied when it is a view of a parameter (a static
    router's): FSDP frees a layer's gathered parameters when the layer's backward ends, before the
    earlier layers' backward reads the weight. The copy is ``kv x S*kv`` numbers (``x head_dim``
    per-dim), 1 / (B*T) of the read that uses it; a computed weight (the dynamic router's, as large as
    the positions) is the buffer's own already and is not copied.
    """
    base = weight if weight._base is None else weight._base
    return weight.detach().clone() if isinstance(base, torch.nn.Parameter) else weight.detach()


def pieces(first: int, stop: int, step: int) -> list[tuple[int, int]]:
    """Layers ``first .. stop-1`` cut at the multiples of ``step`` (the buffer's chunk boundaries)."""
    cuts = [first, *range((first // step + 1) * step, stop, step), stop]
    return list(pairwise(cuts))


def weight_axis(mode: str) -> int:
    """The axis of a ``mode`` weight (``_RoutedRead``) that runs over source heads."""
    return 2 if mode == "per-position" else 1


def _columns(weight: torch.Tensor, kv: int, mode: str, lo: int, hi: int) -> torch.Tensor:
    """The column blocks ``lo .. hi-1`` (one per source layer, ``kv`` heads each) of ``weight``: a view."""
    return weight.narrow(weight_axis(mode), lo * kv, (hi - lo) * kv)


def _joined(blocks: list, axis: int, lo: int, hi: int) -> torch.Tensor:
    """``blocks[lo:hi]`` (tensors) side by side on ``axis``: the block itself if one, else a copy."""
    return blocks[lo] if hi == lo + 1 else torch.cat(blocks[lo:hi], axis)


def _mix(weight, source, kv: int, runs, mode: str, step: int) -> torch.Tensor:
    """Heads ``[kv, *row]`` mixed by a ``mode`` weight (``_RoutedRead``) from the layers ``runs``
    name. ``weight(lo, hi)`` gives its column blocks ``lo .. hi-1`` and ``source(a, b)`` layers
    ``a .. b-1`` as heads ``[n, *row]`` (as ``KVBuffer.block``); both are called per GEMM, so
    either side may be stored in pieces. Run ``(first, stop, pos)`` pairs layers ``first .. stop-1``
    with column blocks from ``pos``; each GEMM covers the layers between two multiples of ``step``
    (``pieces``), and the pieces are summed in place (through ``out=``, which FLOP counters see,
    unlike ``addmm_``)."""
    out = None
    for first, stop, pos in runs:
        for a, b in pieces(first, stop, step):
            src = source(a, b)
            # in the buffer's dtype, as autocast would cast it (pieces summed through out= and
            # backward's reads run outside autocast; fp32 weights with a bf16 buffer)
            w = weight(pos + a - first, pos + b - first).to(src.dtype)
            if mode == "matrix":  # one [kv, s] @ [s, B*T*hd] product
                row, src = src.shape[1:], src.flatten(1)
                out = w @ src if out is None else torch.addmm(out, w, src, out=out)
            else:  # per-dim: one [kv, s] @ [s, B*T] product per feature; per-position: [kv, s] @ [s, hd] per position
                # per-dim's weights contiguous (small): with this strided batch operand the CPU baddbmm
                # falls back to one addmm_ per feature, cloning each slice
                w = w.permute(2, 0, 1).contiguous() if mode == "per-dim" else w
                src = src.transpose(0, 1)
                if out is None and mode == "per-dim":
                    # the [hd, kv, B*T] products written into a [kv, hd, B*T] tensor, the buffer's
                    # layout, so that a raw K/V gradient is a view of it, not a transposing copy
                    out = torch.bmm(w, src, out=src.new_empty(kv, *src.shape[::2]).transpose(0, 1))
                elif out is None:
                    out = torch.bmm(w, src)
                else:
                    out = torch.baddbmm(out, w, src, out=out)
    assert out is not None  # a mix has at least one source
    return out.view(kv, *row) if mode == "matrix" else out.transpose(0, 1)


def _weight_grad(
    grad_out: torch.Tensor, data: list[torch.Tensor], buffer: KVBuffer, runs, mode: str
) -> torch.Tensor:
    """``d <grad_out, read(data)> / d weight`` for the keys or values chunks ``data``, in ``weight``'s
    layout (``_RoutedRead``).

    Computed in the reads' pieces (one per buffer chunk, ``pieces``): on the CPU ``[kv, n] @ [n, s]``
    slows with ``s`` as the reads do (bench/RESULTS.md, "Weight gradients in the reads' pieces")."""
    parts = []
    for first, stop, _ in runs:
        for a, b in pieces(first, stop, buffer.chunk_layers):
            src = buffer.stored(data, a, b)
            if mode == "matrix":
                parts.append(grad_out.flatten(1) @ src.flatten(1).t())
            else:  # batched over features (per-dim) or positions (per-position), as in _mix
                part = torch.bmm(grad_out.transpose(0, 1), src.permute(1, 2, 0))
                parts.append(part.permute(1, 2, 0) if mode == "per-dim" else part)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2 if mode == "per-position" else 1)
