"""Jobs on the platform: the ledger, submission, results, previews and the OpenAI-style routes."""
