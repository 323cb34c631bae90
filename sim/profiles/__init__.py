"""Shipped simulator profiles (JSON): `pdcluster sim --profile NAME` finds NAME.json here."""
