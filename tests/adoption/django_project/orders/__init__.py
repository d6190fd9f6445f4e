"""The adopting team's OWN orders app (a name the library must never shadow)."""
