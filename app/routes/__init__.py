"""HTTP routes, each declared from its ``contract.endpoints`` entry (``declare``).

Terse by design: the logic lives in the runtime's components."""
