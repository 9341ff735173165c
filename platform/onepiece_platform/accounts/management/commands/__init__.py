"""The accounts app's commands: ensure_admin and ensure_demo_user."""
