//! The final check of the Order system: exactly-once effects, compared across the three
//! databases and what the clients were told.
//!
//! For every order in the order service's database: delivery reserved exactly one slot and
//! billing charged exactly once; a cancelled order has exactly one release and one refund (of
//! the charged amount), an open one none. No ledger row names an order that does not exist —
//! rejected requests and rolled-back orders have no effect anywhere. No consumer parked a
//! message. When the load generator's [`LoadReport`] is given, the orders table holds exactly
//! the orders it was answered 201 for, cancelled exactly where its cancel was answered 200.
//!
//! The same function serves the demo (SQLite, in-process bus) and the end-to-end tests
//! (PostgreSQL, NATS or Kafka, the relay as a separate process).

use std::collections::{HashMap, HashSet};
use std::fmt;

use uuid::Uuid;

use crate::Error;
use crate::consumers::{Action, Consumer, LedgerEntry};
use crate::load::LoadReport;
use crate::order::{OrderStatus, OrderStore};

/// Most violations listed one by one; the rest are counted.
const LISTED: usize = 20;

/// What the check found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Orders in the order service's database.
    pub orders: usize,
    /// Of which cancelled.
    pub cancelled: usize,
    /// Delivery ledger: reservations and releases.
    pub reserved: usize,
    /// Delivery ledger: releases.
    pub released: usize,
    /// Billing ledger: charges.
    pub charged: usize,
    /// Billing ledger: refunds.
    pub refunded: usize,
    /// Messages the consumers parked.
    pub parked: u64,
    /// How many violations there were.
    pub violation_count: usize,
    /// The first violations, described.
    pub violations: Vec<String>,
}

impl CheckReport {
    /// Whether every promise held.
    pub fn ok(&self) -> bool {
        self.violation_count == 0
    }

    fn violation(&mut self, what: String) {
        self.violation_count += 1;
        if self.violations.len() < LISTED {
            self.violations.push(what);
        }
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} orders ({} cancelled); delivery {} reserved / {} released; billing {} charged / {} refunded; {} parked; {} violation(s)",
            self.orders,
            self.cancelled,
            self.reserved,
            self.released,
            self.charged,
            self.refunded,
            self.parked,
            self.violation_count
        )?;
        for v in &self.violations {
            write!(f, "\n  - {v}")?;
        }
        if self.violation_count > self.violations.len() {
            write!(
                f,
                "\n  - … and {} more",
                self.violation_count - self.violations.len()
            )?;
        }
        Ok(())
    }
}

/// Read the three databases and check them (see the module docs).
pub async fn verify(
    orders: &OrderStore,
    delivery: &Consumer,
    billing: &Consumer,
    clients: Option<&LoadReport>,
) -> Result<CheckReport, Error> {
    let statuses = orders.statuses().await?;
    let delivery_ledger = delivery.ledger().await?;
    let billing_ledger = billing.ledger().await?;
    let parked = delivery.parked_count().await? + billing.parked_count().await?;
    Ok(check(
        &statuses,
        &delivery_ledger,
        &billing_ledger,
        parked,
        clients,
    ))
}

/// The check itself, on data already read.
pub fn check(
    orders: &[(Uuid, OrderStatus)],
    delivery: &[LedgerEntry],
    billing: &[LedgerEntry],
    parked: u64,
    clients: Option<&LoadReport>,
) -> CheckReport {
    let mut report = CheckReport {
        orders: orders.len(),
        cancelled: orders
            .iter()
            .filter(|(_, s)| *s == OrderStatus::Cancelled)
            .count(),
        parked,
        ..CheckReport::default()
    };
    let mut counts: HashMap<(Uuid, Action), Vec<i64>> = HashMap::new();
    for e in delivery.iter().chain(billing) {
        counts
            .entry((e.order_id, e.action))
            .or_default()
            .push(e.value);
        match e.action {
            Action::Reserve => report.reserved += 1,
            Action::Release => report.released += 1,
            Action::Charge => report.charged += 1,
            Action::Refund => report.refunded += 1,
        }
    }
    let n = |id: Uuid, a: Action| counts.get(&(id, a)).map_or(0, Vec::len);

    for &(id, status) in orders {
        let closing = if status == OrderStatus::Cancelled {
            1
        } else {
            0
        };
        for (action, want) in [
            (Action::Reserve, 1),
            (Action::Charge, 1),
            (Action::Release, closing),
            (Action::Refund, closing),
        ] {
            let got = n(id, action);
            if got != want {
                report.violation(format!(
                    "order {id} ({status:?}): {got} × {action:?}, expected {want}"
                ));
            }
        }
        if let (Some(charges), Some(refunds)) = (
            counts.get(&(id, Action::Charge)),
            counts.get(&(id, Action::Refund)),
        ) && charges.first() != refunds.first()
        {
            report.violation(format!(
                "order {id}: refunded {:?} cents but charged {:?}",
                refunds.first(),
                charges.first()
            ));
        }
    }

    let known: HashSet<Uuid> = orders.iter().map(|(id, _)| *id).collect();
    let mut strangers: Vec<&(Uuid, Action)> = counts
        .keys()
        .filter(|(id, _)| !known.contains(id))
        .collect();
    strangers.sort_by_key(|(id, a)| (*id, format!("{a:?}")));
    for (id, action) in strangers {
        report.violation(format!(
            "{action:?} for order {id}, which does not exist (a rejected or rolled-back request had an effect)"
        ));
    }

    if parked > 0 {
        report.violation(format!("the consumers parked {parked} message(s)"));
    }

    if let Some(clients) = clients {
        for id in clients.created.difference(&known) {
            report.violation(format!(
                "order {id} was answered 201 but is not in the database"
            ));
        }
        for id in known.difference(&clients.created) {
            report.violation(format!(
                "order {id} is in the database but no client was answered 201 for it"
            ));
        }
        let cancelled: HashSet<Uuid> = orders
            .iter()
            .filter(|(_, s)| *s == OrderStatus::Cancelled)
            .map(|(id, _)| *id)
            .collect();
        for id in cancelled.symmetric_difference(&clients.cancelled) {
            report.violation(format!(
                "order {id}: the database and the clients disagree on whether it is cancelled"
            ));
        }
        for what in &clients.unexpected {
            report.violation(format!("unexpected HTTP answer: {what}"));
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(order_id: Uuid, action: Action, value: i64) -> LedgerEntry {
        LedgerEntry {
            order_id,
            action,
            value,
        }
    }

    #[test]
    fn exact_effects_pass() {
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let orders = [(a, OrderStatus::Created), (b, OrderStatus::Cancelled)];
        let delivery = [
            entry(a, Action::Reserve, 1),
            entry(b, Action::Reserve, 2),
            entry(b, Action::Release, 0),
        ];
        let billing = [
            entry(a, Action::Charge, 100),
            entry(b, Action::Charge, 200),
            entry(b, Action::Refund, 200),
        ];
        let report = check(&orders, &delivery, &billing, 0, None);
        assert!(report.ok(), "{report}");
        assert_eq!((report.reserved, report.refunded), (2, 1));
    }

    #[test]
    fn doubled_missing_and_stranger_effects_fail() {
        let (a, b, ghost) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let orders = [(a, OrderStatus::Created), (b, OrderStatus::Cancelled)];
        let delivery = [
            entry(a, Action::Reserve, 1),
            entry(a, Action::Reserve, 1),
            entry(b, Action::Reserve, 2),
            entry(ghost, Action::Reserve, 1),
        ];
        let billing = [
            entry(a, Action::Charge, 100),
            entry(b, Action::Charge, 200),
            entry(b, Action::Refund, 150),
        ];
        let report = check(&orders, &delivery, &billing, 1, None);
        // a reserved twice; b not released; b refund ≠ charge; ghost; parked.
        assert_eq!(report.violation_count, 5, "{report}");
    }

    #[test]
    fn client_view_must_match() {
        let a = Uuid::now_v7();
        let orders = [(a, OrderStatus::Created)];
        let delivery = [entry(a, Action::Reserve, 1)];
        let billing = [entry(a, Action::Charge, 1)];
        let mut clients = LoadReport::default();
        clients.created.insert(Uuid::now_v7());
        let report = check(&orders, &delivery, &billing, 0, Some(&clients));
        assert_eq!(report.violation_count, 2, "{report}");
    }
}
