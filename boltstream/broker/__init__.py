"""Everything that talks to the Kafka-compatible broker: client settings, topics, dead letters, topic ranges
and the replay's done marker."""
