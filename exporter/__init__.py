"""nucleus-export's service side: CLI now; job runner, store, API later."""
