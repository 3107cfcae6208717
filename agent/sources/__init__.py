"""Local sources: the box's own cameras, files and sensors, run through a model continuously.

Modules: `base` (the record a reader makes, the reader protocol, errors), `readers` (a
package, one module a kind: `synthetic`, `video`, `folder`, `pipe`, `pcm`, and `open_reader`),
`frames` (a frame; its fields as the model's inputs, the outputs it streams), `stream` (the
source's chunk messages), `seq` (the persisted `seq`), `counters` (a source's counters and
how it bears failing frames and records), `runner` (a source's thread, frame slot, ticket
and the worker's side of a frame), `pcm` (the runner of a pcm source: a scan model's
windows with the state carried through them), `transcribe` (a pcm source through a speech
recogniser: a generate run a window), `manager` (every source of an agent; the Prometheus
collector).

Each `[[sources]]` entry of the configuration becomes a :class:`SourceRunner` with one named
thread (`source-NAME`) that reads frames or records and hands them to the same scheduler as
MQTT requests, at the source's `priority`. Results stream on `ROOT/stream/NAME` in the reply
envelope (`id` = NAME, `type` "chunk", `index` = frame number), through the same outbox, and
so the spool for QoS 1/2, as replies.

Why it is built this way:

* **One frame of a source at a time.** A source keeps at most one job in the scheduler queue
  (a ticket); the worker that takes it picks the frame *then*: the newest one under
  `policy = "latest"`, the oldest under `"all"`. A slow model therefore never lets a queue
  of stale frames build up, requests at a higher priority overtake a busy source after the
  frame in the model, and results leave in frame order, so `index` grows with `seq`. While
  nothing else waits, the worker goes on with the next frame itself (warm caches), and
  the results of frames run back to back share socket writes (`agent.inference.send_hold`).
  A pcm record is the whole chunks one read completed (up to 16), each its own message and
  index: one hand-over between the threads for all of them; a request that comes to wait
  for a worker meanwhile runs between two chunks, the rest of the record after it
  (docs/decisions/0035).
* **Bounded everywhere.** `latest` holds one waiting frame (a newer one replaces it and the
  old one is counted as dropped); `all` holds up to `queue` frames and then the source
  thread waits, which pushes back on a pipe's writer or a folder's scan. A full outbox
  blocks the worker as for replies, which the source sees as a slow model.
* **`seq` never restarts.** Every stream message takes the next `seq`; the number is kept in
  `state_dir/sources/NAME.seq` ahead of use (:class:`SeqStore`), so neither a restart nor
  a crash reuses one.
* **Failures cost the source, not the agent.** Opening, reading and decoding problems are
  logged, published as a `source_failed` event and retried with capped, jittered backoff;
  a bad frame or file costs one error.
"""

from agent.sources.base import FIELD, FramingError, Record, SourceError
from agent.sources.manager import SourceCollector, SourceManager
from agent.sources.readers import cbor_item_end, load_array_file
from agent.sources.runner import SourceJob, SourceRunner
from agent.sources.seq import SeqStore

__all__ = [
    "FIELD",
    "FramingError",
    "Record",
    "SeqStore",
    "SourceCollector",
    "SourceError",
    "SourceJob",
    "SourceManager",
    "SourceRunner",
    "cbor_item_end",
    "load_array_file",
]
