"""What the tests of a real run use to break it on purpose (fault_injection): hooks the product calls at named
points, inert unless the test's environment variable is set."""
