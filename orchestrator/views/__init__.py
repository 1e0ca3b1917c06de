"""Views of a job: they read events and statuses and own the terminal; they never touch SSH."""
