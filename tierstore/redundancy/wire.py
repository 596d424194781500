"""Bytes between ranks over the checkpoint's process group: a plan of flows every rank
builds alike, each rank running its own flows in the plan's order.

A flow moves ``length`` bytes from rank ``src`` to rank ``dst`` in chunks. The sender reads
them from a :class:`Source` (a file of a tier; a source that fails mid-way sends zeros for the
rest, so the receiver's checksum fails instead of the protocol losing step); the receiver
hands each chunk to a :class:`Sink`. Sends are asynchronous (at most ``WINDOW`` chunks in
flight per rank) and receives block, in the plan's one order on every rank: the earliest flow
not done always has its sender and its receiver at it, so the plan never deadlocks.

A peer that dies (a lost node) makes the receive or send raise; :func:`run` raises
:class:`PeerLost` naming it, after which the group is not used again for this round.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tierstore.errors import TierstoreError
from tierstore.storage import faults

__all__ = ["CHUNK", "Flow", "PeerLost", "Sink", "Source", "run"]

log = logging.getLogger(__name__)

# Bytes per message: gloo's throughput is flat from a few MiB up, and messages this size let
# the disk and the wire overlap (two buffers per stream).
CHUNK = 8 << 20
WINDOW = 3  # sends in flight per rank


class PeerLost(TierstoreError):
    """A peer rank stopped answering in the middle of a transfer."""


class Source(Protocol):
    def read(self, size: int) -> bytes: ...
    def close(self) -> None: ...


class Sink(Protocol):
    def write(self, data: memoryview) -> None: ...
    def close(self) -> None: ...


@dataclass
class Flow:
    """``length`` bytes from ``src`` to ``dst``; ``source`` is set on the sender only,
    ``sink`` on the receiver only (a rank builds the whole plan, but opens only its own)."""

    src: int
    dst: int
    length: int
    source: Callable[[], Source] | None = None
    sink: Callable[[], Sink] | None = None
    tag: Any = field(default=None, compare=False)


def run(
    flows: Iterable[Flow],
    rank: int,
    group: Any,
    *,
    chunk: int = CHUNK,
    progress: Callable[[int], None] | None = None,
    ordered: bool = True,
) -> int:
    """Run this rank's part of ``flows`` (every rank passes the same plan, in the same
    order); the bytes this rank received.

    ``ordered``: each rank's flows complete in the plan's order (what parity's sinks need:
    each combines the flows of several senders in turn). Otherwise (every sink on its own:
    copies of files) the flows between each pair of ranks form one stream, and all streams
    run at once, in stages: each rank posts one message of each of its outgoing streams,
    then takes one message of each incoming stream, so every rank sends and receives at the
    same time instead of in a chain from the first sender to the last."""
    if not ordered:
        return _run_streams(list(flows), rank, group, chunk, progress)
    inflight: deque[tuple[Any, torch.Tensor]] = deque()
    received = 0
    try:
        for flow in flows:
            if rank not in (flow.src, flow.dst):
                continue
            if flow.length <= 0 or flow.src == flow.dst:  # nothing crosses: an empty file, or a copy at home
                if rank == flow.dst and flow.sink is not None and flow.length <= 0:
                    flow.sink().close()
                continue
            if rank == flow.src:
                _send(flow, group, chunk, inflight)
            else:
                received += _receive(flow, group, chunk, progress)
            faults.point("peers.flow_done")  # a rank lost between two files of a round
        while inflight:
            inflight.popleft()[0].wait()
    except (RuntimeError, OSError) as err:  # gloo: a closed connection, a timeout
        raise PeerLost(f"a peer stopped answering during a transfer: {err}") from err
    return received


def _send(flow: Flow, group: Any, chunk: int, inflight: deque[tuple[Any, torch.Tensor]]) -> None:
    assert flow.source is not None, "the sender's flow has no source"
    source: Source | None = None
    try:
        source = flow.source()
    except (TierstoreError, OSError) as err:
        log.error("cannot read what rank %d expects (sending zeros, which it will refuse): %s", flow.dst, err)
    done = 0
    readinto = getattr(source, "readinto", None)
    while done < flow.length:
        size = min(chunk, flow.length - done)
        buffer = bytearray(size)  # zeros past what the source gives
        if source is not None:
            try:
                if readinto is not None:
                    readinto(memoryview(buffer))  # straight into the message: no copy
                else:
                    data = source.read(size)
                    buffer[: len(data)] = data
            except (TierstoreError, OSError) as err:
                log.error("read failed mid-way (sending zeros, which rank %d will refuse): %s", flow.dst, err)
                source = None
        tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        while len(inflight) >= WINDOW:
            inflight.popleft()[0].wait()
        inflight.append((dist.isend(tensor, flow.dst, group=group), tensor))
        done += size
    if source is not None:
        source.close()


def _receive(flow: Flow, group: Any, chunk: int, progress: Callable[[int], None] | None) -> int:
    assert flow.sink is not None, "the receiver's flow has no sink"
    sink: Sink | None = flow.sink()
    done = 0
    raw = bytearray(min(chunk, flow.length))
    buffer, view = torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)
    try:
        while done < flow.length:
            size = min(chunk, flow.length - done)
            dist.recv(buffer[:size], flow.src, group=group)
            if sink is not None:
                sink.write(view[:size])
            done += size
            if progress is not None:
                progress(size)
    finally:
        if sink is not None:
            sink.close()
    return done


class _Stream:
    """The flows between one pair of ranks, in plan order, as messages of at most ``chunk``,
    through two buffers in turn: one is on the wire (or being written) while the other is
    filled (or received)."""

    def __init__(self, peer: int, flows: list[Flow], chunk: int) -> None:
        self.peer, self.chunk = peer, chunk
        self.messages = [
            (flow, at, min(chunk, flow.length - at)) for flow in flows for at in range(0, flow.length, chunk)
        ]
        self.next = 0
        size = min(chunk, max((size for _, _, size in self.messages), default=0))
        self.buffers = [bytearray(size), bytearray(size)] if size else []
        self.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self.busy: list[Any] = [None, None]  # a buffer's send, or its write, not done yet
        self.source: Source | None = None
        self.readinto: Callable[[memoryview], int] | None = None
        self.sink: Sink | None = None  # the writer thread's only

    def pending(self) -> bool:
        return self.next < len(self.messages)

    def free(self, b: int) -> None:
        """Wait until buffer ``b`` is neither on the wire nor being written."""
        busy, self.busy[b] = self.busy[b], None
        if busy is None:
            return
        if isinstance(busy, Future):
            busy.result()
        else:
            busy.wait()


def _run_streams(
    flows: list[Flow], rank: int, group: Any, chunk: int, progress: Callable[[int], None] | None
) -> int:
    outgoing: dict[int, list[Flow]] = {}
    incoming: dict[int, list[Flow]] = {}
    for flow in flows:
        if rank not in (flow.src, flow.dst):
            continue
        if flow.length <= 0 or flow.src == flow.dst:
            if rank == flow.dst and flow.sink is not None and flow.length <= 0:
                flow.sink().close()
            continue
        if rank == flow.src:
            outgoing.setdefault(flow.dst, []).append(flow)
        else:
            incoming.setdefault(flow.src, []).append(flow)
    sends = [_Stream(peer, fs, chunk) for peer, fs in outgoing.items()]
    receives = [_Stream(peer, fs, chunk) for peer, fs in incoming.items()]
    received = 0
    # One thread writes what arrived, in arrival order per stream, while the next message
    # comes in: the disk and the wire work at once.
    writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-copies-write") if receives else None
    try:
        while any(s.pending() for s in sends) or any(s.pending() for s in receives):
            for stream in sends:
                if stream.pending():
                    _post_send(stream, group)
            taking = []
            for stream in receives:
                if stream.pending():
                    message, b = stream.messages[stream.next], stream.next % 2
                    stream.next += 1
                    stream.free(b)  # its previous message is written
                    taking.append(
                        (
                            stream,
                            message,
                            b,
                            dist.irecv(stream.tensors[b][: message[2]], stream.peer, group=group),
                        )
                    )
            for stream, message, b, work in taking:
                assert work is not None and writer is not None
                work.wait()
                stream.busy[b] = writer.submit(_deliver, stream, message, b)
                received += message[2]
                if progress is not None:
                    progress(message[2])
        for stream in sends + receives:
            stream.free(0)
            stream.free(1)
    except (RuntimeError, OSError) as err:  # gloo: a closed connection, a timeout
        raise PeerLost(f"a peer stopped answering during a transfer: {err}") from err
    finally:
        if writer is not None:
            writer.shutdown(wait=True)
        for stream in receives:
            if stream.sink is not None:
                stream.sink.close()  # short of its bytes: the sink refuses to keep it
        for stream in sends:
            if stream.source is not None:
                stream.source.close()
    return received


def _post_send(stream: _Stream, group: Any) -> None:
    """Read the stream's next message into a free buffer and post it (zeros past a source that
    failed or ended early: the receiver's check refuses the file)."""
    flow, at, size = stream.messages[stream.next]
    b = stream.next % 2
    stream.next += 1
    if at == 0:
        stream.source, stream.readinto = None, None
        assert flow.source is not None, "the sender's flow has no source"
        try:
            stream.source = flow.source()
            stream.readinto = getattr(stream.source, "readinto", None)
        except (TierstoreError, OSError) as err:
            log.error(
                "cannot read what rank %d expects (sending zeros, which it will refuse): %s", flow.dst, err
            )
    stream.free(b)  # its message of two stages ago has left
    view = memoryview(stream.buffers[b])[:size]
    got = 0
    if stream.source is not None:
        try:
            if stream.readinto is not None:
                got = stream.readinto(view)
            else:
                data = stream.source.read(size)
                got = len(data)
                view[:got] = data
        except (TierstoreError, OSError) as err:
            log.error("read failed mid-way (sending zeros, which rank %d will refuse): %s", flow.dst, err)
            stream.source = None
    if got < size:
        view[got:] = bytes(size - got)
    stream.busy[b] = dist.isend(stream.tensors[b][:size], stream.peer, group=group)
    if at + size >= flow.length:  # the flow's last message is posted
        if stream.source is not None:
            stream.source.close()
            stream.source = None
        faults.point("peers.flow_done")


def _deliver(stream: _Stream, message: tuple[Flow, int, int], b: int) -> None:
    """Hand a message received into buffer ``b`` to its flow's sink, opening and closing it at
    the flow's ends (on the writer thread, in the stream's order)."""
    flow, at, size = message
    if at == 0:
        assert flow.sink is not None, "the receiver's flow has no sink"
        stream.sink = flow.sink()
    assert stream.sink is not None
    stream.sink.write(memoryview(stream.buffers[b])[:size])
    if at + size >= flow.length:
        stream.sink.close()
        stream.sink = None
        faults.point("peers.flow_done")
