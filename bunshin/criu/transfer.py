"""Moving an image between nodes over any transport that carries byte chunks in order.

>>> for chunk in pack(path, layers=receiver_lacks): send(chunk)       # doctest: +SKIP
>>> unpack(received_chunks, dest); Template.load(dest)                 # doctest: +SKIP

``pack`` gives the image directory (and, optionally, rootfs layers of this node's store) as a
stream of frames, ``unpack`` writes them back: the image into ``dest``, each layer into the
receiver's store once its digest is checked. A frame is a kind byte, an 8-byte little-endian
length and that many bytes: ``H`` opens a part (JSON: ``{"part": "image"}`` or ``{"part":
"layer", "digest": ...}``), ``D`` carries a piece of the part's tar stream, ``E`` closes the
part, ``Z`` ends the stream (a stream cut short is refused). Memory stays at one chunk on both
sides, whatever the layers weigh. A receiver that does not take the layers with the image asks
for what it lacks (:func:`missing_layers`) and fetches each with ``layer_chunks`` on the owner
and :func:`receive_layer` here, or passes such a callable to ``Template.load(layers=...)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ..errors import ImageError
from . import bases, images, layerstore
from .layerstore import layer_chunks, receive_layer

__all__ = ["image_layers", "layer_chunks", "missing_layers", "pack", "receive_layer", "unpack"]

_CHUNK = 1 << 20
_HEAD = 9


def _frame(kind: bytes, payload: bytes) -> bytes:
    return kind + len(payload).to_bytes(8, "little") + payload


def image_layers(path: str | os.PathLike) -> list[str]:
    """The rootfs layer digests the image at ``path`` stands on."""
    return bases.digests(images.check_meta(path))


def missing_layers(path: str | os.PathLike) -> list[str]:
    """The rootfs layer digests the image at ``path`` stands on that this node's store lacks."""
    return [d for d in image_layers(path) if layerstore.local(d) is None]


def pack(path: str | os.PathLike, layers: Sequence[str] = (), chunk: int = _CHUNK) -> Iterator[bytes]:
    """The image at ``path`` and the rootfs layers ``layers`` (digests in this node's store)
    as a stream of frames, one chunk at a time (see the module docstring)."""
    src = Path(path)
    images.check_meta(src)  # a damaged image is refused here, not on the receiver
    yield _frame(b"H", json.dumps({"part": "image"}).encode())
    for b in layerstore.tar_chunks(src, chunk):
        yield _frame(b"D", b)
    yield _frame(b"E", b"")
    for digest in layers:
        yield _frame(b"H", json.dumps({"part": "layer", "digest": digest}).encode())
        for b in layer_chunks(digest, chunk):
            yield _frame(b"D", b)
        yield _frame(b"E", b"")
    yield _frame(b"Z", b"")


class _Frames:
    """Frames out of chunks cut anywhere."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            try:
                self._buf += next(self._it)
            except StopIteration:
                raise ImageError("the image stream ended in the middle: cut short in transit") from None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def next(self) -> tuple[bytes, bytes]:
        head = self._take(_HEAD)
        kind, n = head[:1], int.from_bytes(head[1:], "little")
        if kind not in (b"H", b"D", b"E", b"Z"):
            raise ImageError(f"the image stream holds a frame of kind {kind!r}: not a Bunshin image stream")
        return kind, self._take(n)

    def part(self) -> Iterator[bytes]:
        """The data of the open part, up to its ``E`` frame."""
        while True:
            kind, payload = self.next()
            if kind == b"E":
                return
            if kind != b"D":
                raise ImageError(f"the image stream holds a {kind!r} frame inside a part: malformed")
            yield payload


def _untar(chunks: Iterable[bytes], dest: Path) -> None:
    rc, err = layerstore.untar(chunks, dest)
    if rc != 0:
        raise ImageError(f"unpacking the image into {dest} failed: {err}")


def unpack(chunks: Iterable[bytes], dest: str | os.PathLike) -> list[str]:
    """Write a :func:`pack` stream: the image into ``dest`` (a new or empty directory), its
    layers into this node's store; returns the layer digests received. On failure ``dest`` is
    left as it was found (layers already checked and stored stay)."""
    existed = Path(dest).exists()
    out = images.prepare(dest)
    received: list[str] = []
    try:
        for d in ("criu", "layers"):  # the stream brings them
            (out / d).rmdir()
        frames = _Frames(chunks)
        while True:
            kind, payload = frames.next()
            if kind == b"Z":
                break
            if kind != b"H":
                raise ImageError(f"the image stream holds a {kind!r} frame where a part begins: malformed")
            head = json.loads(payload)
            if head.get("part") == "image":
                _untar(frames.part(), out)
            elif head.get("part") == "layer":
                receive_layer(head["digest"], frames.part(), "an image stream")
                received.append(head["digest"])
            else:
                raise ImageError(f"the image stream holds an unknown part {head!r}")
        images.check_meta(out)
    except BaseException:
        images.discard(out, keep_dir=existed)
        raise
    return received
