"""The kinds of local source, one module each, and the opening of the one a source names.

Modules: `synthetic` (generated inputs at a rate), `video` (OpenCV: files, stream URLs,
cameras, GStreamer pipelines), `folder` (files dropped into a folder; checked .npy/.npz
loading), `pipe` (a CBOR sequence on a FIFO, a file or stdin; the framing of its records),
`pcm` (raw samples from a command, a FIFO or a file, cut into a scan model's windows; opened
by agent.sources.pcm, which checks the model first).

Every reader follows agent.sources.base: it is opened by its constructor, yields `Record`s
from `records()` on the source's thread, raises `SourceError` when the source cannot go on
(the runner retries it) and reports a bad file or record through `on_bad`, which costs one
error and never the source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.models.backends.base import TensorSpec
from agent.sources.base import Reader, ReaderContext, SourceError
from agent.sources.readers.folder import FolderReader, load_array_file
from agent.sources.readers.pcm import PcmReader
from agent.sources.readers.pipe import PipeReader, cbor_item_end
from agent.sources.readers.synthetic import SyntheticReader
from agent.sources.readers.video import VideoReader

__all__ = [
    "FolderReader",
    "PcmReader",
    "PipeReader",
    "SyntheticReader",
    "VideoReader",
    "cbor_item_end",
    "load_array_file",
    "open_reader",
]


def open_reader(
    ctx: ReaderContext, specs: Sequence[TensorSpec], on_bad: Callable[[str], None]
) -> Reader:
    """The reader of the source's `kind`, open; `specs` are the serving model's inputs (the
    synthetic kind makes them). Raises SourceError when the source cannot be opened."""
    kind = ctx.config.kind
    if kind == "synthetic":
        return SyntheticReader(ctx, specs)
    if kind == "video":
        return VideoReader(ctx)
    if kind == "folder":
        return FolderReader(ctx, on_bad)
    if kind == "pcm":  # its windows depend on the model: agent.sources.pcm opens it
        raise SourceError("a pcm source opens through agent.sources.pcm.PcmSourceRunner")
    return PipeReader(ctx, on_bad)
