"""HTTP routes. Terse by design: the logic lives in the runtime's components."""
