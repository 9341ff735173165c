"""The jobs app's REST API: the native job routes and the OpenAI-style videos and images surface."""
