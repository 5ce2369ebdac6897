"""Model configurations, engine pins and model inspection."""
