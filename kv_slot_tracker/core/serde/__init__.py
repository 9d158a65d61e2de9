"""An emulator of the texts with which the reference (Rust: serde, serde_json,
serde_path_to_error) refuses a request body, word for word and position included.

``syntax``: a body that is not JSON or ends early; ``shapes``: JSON of the wrong shape for a
struct, from the validator's errors; ``sequences``: a struct read from a JSON array, field by
field; ``positions``: where each value of a JSON text ends; ``values``: how serde names a
value. Pure: bytes and the validator's error details in, texts (or ``errors``) out; the HTTP
edge (``kv_slot_tracker.http.body``) adds the prefixes and status codes."""
