"""specd.coordinator"""
