"""The real transfer backend: Mooncake transfer engine + ZMQ + the HTTP bootstrap server.

- `layout`: `KVArgs` (one rank's registered buffers) and the TP-mismatch arithmetic.
- the wire messages are runtime/protocol/transfer.py (versioned msgpack).
- `mooncake_engine`: a checked wrapper of Mooncake's `TransferEngine`.
- `metadata`: first-token metadata slots in registered memory.
- `channel`: ZMQ PULL/PUSH sockets carrying those messages.
- `state`: a room's forward-only state and the manager's poll epoch.
- `prefill`, `decode`: the two halves of the protocol; `mooncake`: the manager, sender, receiver.
- `bootstrap_server`: the HTTP bootstrap server (rank discovery) and its client.

Importing this package does not import mooncake; constructing a manager does.
"""
