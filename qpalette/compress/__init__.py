"""compress"""
