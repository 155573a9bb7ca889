//! The UTC date and time of a Unix time, for log headers and log file
//! names, computed without a time-zone database.

use std::time::{SystemTime, UNIX_EPOCH};

/// A UTC date and time of day.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Civil {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u64,
    pub minute: u64,
    pub second: u64,
}

impl Civil {
    /// The current UTC time, to the second.
    pub fn now() -> Civil {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Civil::from_unix(now.as_secs())
    }

    /// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian).
    pub fn from_unix(seconds: u64) -> Civil {
        let days = (seconds / 86_400) as i64 + 719_468;
        let era = days.div_euclid(146_097);
        let day_of_era = days.rem_euclid(146_097);
        let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
        let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
        let month_index = (5 * day_of_year + 2) / 153;
        let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
        let month = if month_index < 10 {
            month_index + 3
        } else {
            month_index - 9
        } as u32;
        let year = year_of_era + era * 400 + i64::from(month <= 2);
        let time = seconds % 86_400;
        Civil {
            year,
            month,
            day,
            hour: time / 3600,
            minute: time % 3600 / 60,
            second: time % 60,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_match_known_instants() {
        assert_eq!(
            Civil::from_unix(0),
            Civil {
                year: 1970,
                month: 1,
                day: 1,
                hour: 0,
                minute: 0,
                second: 0
            }
        );
        // 2026-12-03T07:44:04Z and a leap day.
        let civil = Civil::from_unix(1_796_283_844);
        assert_eq!((civil.year, civil.month, civil.day), (2026, 12, 3));
        assert_eq!((civil.hour, civil.minute, civil.second), (7, 44, 4));
        let leap = Civil::from_unix(951_782_400);
        assert_eq!((leap.year, leap.month, leap.day), (2000, 2, 29));
    }
}
