"""Every message the serving backend puts on a wire, typed and versioned, on one codec
(`codec`: msgpack for binary links, JSON for HTTP bodies and SSE events; strict decoding, one
`ProtocolError`). Torch-free.

- `step`: what rank 0 of a tensor-parallel instance broadcasts each iteration (`Step`).
- `transfer`: the ZMQ messages between prefill and decode ranks (`RegisterDecode`, ...).
- `worker`: the router's `/generate` body to a worker (`GenerateParams`).
- `stream`: the per-request events an engine emits and a decode worker streams (`StreamEvent`).
"""
