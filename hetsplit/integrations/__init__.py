"""Integrations: hetsplit inside the trainers people already use."""
