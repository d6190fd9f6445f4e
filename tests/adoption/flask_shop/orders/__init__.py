"""The adopting team's OWN orders package (a name the library must never shadow)."""
