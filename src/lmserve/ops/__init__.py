"""Operating a running server: what each request was (RequestRecord) and who watches it.

Tracing, payload logging, validation rules and drift detection each consume finished
RequestRecords through `Ops`; none of them sits on the engine's hot path.
"""
