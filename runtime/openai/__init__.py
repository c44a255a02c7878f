"""The OpenAI-compatible front: `protocol` (request parsing and the wire bodies) and `server`
(the HTTP app in front of a local engine or of the PD router)."""
