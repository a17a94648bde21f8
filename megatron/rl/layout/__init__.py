"""A separate inference layout: its process groups, the inference copy, the refit."""
