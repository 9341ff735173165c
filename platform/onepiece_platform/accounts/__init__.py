"""Users' accounts on the platform: API keys, their priority tier, the audit log and the admin's sign-in."""
