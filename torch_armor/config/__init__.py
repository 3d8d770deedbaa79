"""The method configs: what a method is (its config type) and every setting it takes, with their one serialized form."""
