"""How a vLLM server's weights are pushed, from the trainer's buckets to the server's model.

- ``pusher.py``: one push, whatever the transport: pause, send, label with the version, resume.
- ``fan_out.py``: every server of the push at once, behind vLLM's weight-sync client protocol.
- by transport:
  - ``gloo.py`` (rank 0's end), ``gloo_wire.py`` (the wire both ends import) and ``gloo_receiver.py`` (the
    ``trl_async_gloo`` engine inside a server): CPU servers, and the tested twin of the NCCL path;
  - ``nccl.py``: GPU servers, through vLLM's own NCCL engine.
- ``recovery.py``: a lost server's way back (it answers again, as the same server) before it takes work.

The buckets come from ``weights/policy.py`` on every trainer rank, in lock-step on the main thread (under ZeRO-3 each
bucket is a collective gather); only rank 0 sends, and a bucket is sent completely before the next one is gathered.
``engines/vllm/backend.py`` decides who is in each push: the group is opened again when a server is lost or comes
back, a push that breaks off lets every member go, and a server back is re-attached with the whole version and a
greedy probe against a peer.

This package's ``__init__`` imports nothing: a vLLM server imports ``gloo_receiver`` without the trainer's side.
"""
